"""Shard planning so that N engine workers share a batch: at least ``min_shards`` shards when each
keeps ``min_requests``, prefix groups kept together where a boundary is near, every request
planned once, the request and token limits still kept."""
from __future__ import annotations

import pytest

from nightshift.jobs.batches.shard_planning import plan_shards
from nightshift.settings import Settings


def plan(prompts, max_requests=128, budget=65_536, **kw):  # noqa: ANN001, ANN003, ANN201
    return plan_shards(prompts, [16] * len(prompts), budget, max_requests, min_shards=4, min_requests=16, **kw)


def sizes(shards) -> list[int]:  # noqa: ANN001
    return [len(s.members) for s in shards]


def distinct(n: int) -> list[list[int]]:
    return [[1, 2, 3, i] for i in range(n)]


@pytest.mark.parametrize("n, expected", [
    (10, [10]),                      # too few to split: one shard, as before
    (31, [31]),                      # two shards would hold fewer than 16
    (40, [20, 20]),                  # 4 shards would hold 10: as many as keep 16
    (64, [16, 16, 16, 16]),
    (100, [25, 25, 25, 25]),         # the case: no longer one shard
    (200, [50, 50, 50, 50]),
    (1000, [128] * 7 + [104]),       # big batches: shard_max_requests decides, as before
])
def test_a_batch_is_split_into_at_least_min_shards_of_at_least_min_requests(n, expected):
    shards = plan(distinct(n))
    assert sizes(shards) == expected
    assert sorted(i for s in shards for i in s.members) == list(range(n))
    assert [s.seq for s in shards] == list(range(len(shards)))


def test_the_defaults_share_a_100_request_batch_among_workers():
    settings = Settings()
    assert (settings.shard_min_count, settings.shard_min_requests) == (4, 16)
    shards = plan_shards(distinct(100), [16] * 100, settings.shard_token_budget, settings.shard_max_requests,
                         min_shards=settings.shard_min_count, min_requests=settings.shard_min_requests)
    assert len(shards) == 4


def test_prefix_groups_stay_together_when_a_boundary_is_near_and_no_shard_drops_under_the_minimum():
    # 5 groups of 20 requests sharing a 30-token system prompt, interleaved in the input
    groups = [[[g] * 30 + [i] for i in range(20)] for g in range(5)]
    prompts = [groups[g][i] for i in range(20) for g in range(5)]
    shards = plan(prompts)
    assert sizes(shards) == [20, 20, 20, 40]     # cuts moved back to group boundaries, the rest made up
    for s in shards:
        assert len({prompts[i][0] for i in s.members}) == len(s.members) // 20
    # groups of 15: a boundary within reach would leave a shard under 16, so the cut stays
    prompts = [[g] * 30 + [i] for g in range(7) for i in range(15)]
    shards = plan(prompts)
    assert min(sizes(shards)) >= 16 and len(shards) == 4 and sum(sizes(shards)) == 105


def test_the_token_budget_still_bounds_each_shard():
    prompts = [[7] * 100 + [i] for i in range(100)]
    shards = plan(prompts, budget=117 * 10)       # 10 requests of 101 + 16 tokens fit
    assert all(s.planned_tokens <= 1170 for s in shards) and sum(sizes(shards)) == 100
    assert len(shards) == 10


def test_without_a_minimum_count_the_plan_is_the_greedy_one():
    prompts = distinct(100)
    assert sizes(plan_shards(prompts, [16] * 100, 65_536, 128)) == [100]
    assert sizes(plan_shards(prompts, [16] * 100, 65_536, 30)) == [30, 30, 30, 10]


@pytest.mark.parametrize("kw", [{"min_shards": 0}, {"min_requests": 0}])
def test_non_positive_minimums_are_refused(kw):
    with pytest.raises(ValueError):
        plan_shards(distinct(4), [1] * 4, 100, 10, **kw)

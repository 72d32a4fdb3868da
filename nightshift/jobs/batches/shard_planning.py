"""Prefix-grouped shard planning.

Requests are sorted by their prompt token ids, so prompts that share a prefix (a system
prompt, a few-shot header) sit next to each other, then cut greedily into shards of at most
``max_requests`` requests whose planned tokens (prompt + max_tokens) stay within a budget.
Shards are the unit several engine workers share a batch by; a worker streams one shard after
another through its engine, so neighbouring shards still meet in its prefix cache. A cut
prefers a point where the shared prefix with the next request is short, so a group is not
split when a nearby boundary keeps it whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class PlannedShard:
    seq: int
    members: list[int]          # indexes into the planned items, in run order
    planned_tokens: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_shards(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], token_budget: int,
                max_requests: int, lookback: int = 32) -> list[PlannedShard]:
    """Group item indexes into shards of at most ``max_requests`` items and ``token_budget``
    planned tokens (an item bigger than the budget gets a shard of its own). ``lookback`` bounds
    how far back a cut may move to land between two requests that share less prefix."""
    if token_budget < 1 or max_requests < 1:
        raise ValueError("token_budget and max_requests must be positive")
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    costs = [len(prompts[i]) + max(0, max_tokens[i]) for i in order]
    shards: list[PlannedShard] = []
    start = 0
    while start < len(order):
        end, total = start, 0
        while end < len(order) and (end == start or (total + costs[end] <= token_budget
                                                     and end - start < max_requests)):
            total += costs[end]
            end += 1
        if end < len(order) and end - start > 1:
            # Move the cut back (within lookback) to the boundary with the least shared prefix.
            best, best_shared = end, _common_prefix(prompts[order[end - 1]], prompts[order[end]])
            for cut in range(end - 1, max(start + 1, end - lookback) - 1, -1):
                shared = _common_prefix(prompts[order[cut - 1]], prompts[order[cut]])
                if shared < best_shared:
                    best, best_shared = cut, shared
                    if shared == 0:
                        break
            end = best
            total = sum(costs[start:end])
        shards.append(PlannedShard(len(shards), order[start:end], total))
        start = end
    return shards

"""Scheduler: budgets, chunked prefill, preemption, prefix-aware admission, no starvation.

The model is replaced by the bookkeeping the engine does after a step (advance the
computed tokens, append one token per sampled sequence); the scheduling logic under
test is the real one.
"""
import random

from nightshift.engine.block_manager import BlockManager
from nightshift.engine.scheduler import Scheduler
from nightshift.engine.sequence import Sequence, SequenceStatus
from nightshift.engine.types import GenerationRequest, SamplingParams

BS = 4


def make_seq(tokens, rid, max_tokens=4):
    return Sequence(GenerationRequest(rid, list(tokens), SamplingParams(max_tokens=max_tokens)), BS)


def run_to_completion(sched, max_steps=10_000, on_step=None):
    """Drive the scheduler like the engine does; returns finish order and step log."""
    finished, steps = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished, steps
        items = sched.schedule()
        assert items, "scheduler produced an empty step with work left (deadlock)"
        steps.append(items)
        if on_step:
            on_step(items)
        sched.complete_step(items)
        for item in items:
            seq = item.seq
            if item.need_logits:
                seq.append_token(1000 + seq.num_output_tokens, None)
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    sched.finish(seq)
                    finished.append(seq)
    raise AssertionError("did not finish")


def check_budgets(sched):
    def check(items):
        assert len(items) <= sched.max_num_seqs
        assert sum(i.num_new_tokens for i in items) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert len({id(i.seq) for i in items}) == len(items)
    return check


def test_budgets_are_respected_and_every_request_finishes():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=200, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=16)
    seqs = [make_seq([rng.randrange(50) for _ in range(rng.randrange(1, 30))], f"r{i}",
                     max_tokens=rng.randrange(1, 8)) for i in range(40)]
    sched.add(seqs)
    finished, steps = run_to_completion(sched, on_step=check_budgets(sched))
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.num_output_tokens == s.sampling.max_tokens for s in seqs)
    assert bm.num_used_blocks == 0


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_seq([1, 2, 3], "short", max_tokens=10)
    long = make_seq(list(range(100, 130)), "long", max_tokens=2)
    sched.add([short, long])
    _, steps = run_to_completion(sched)
    long_chunks = [i.num_new_tokens for s in steps for i in s if i.seq is long and not i.is_decode]
    assert sum(long_chunks) == 30 and max(long_chunks) <= 8 and len(long_chunks) >= 4
    mixed = [s for s in steps if any(i.is_decode for i in s) and any(not i.is_decode for i in s)]
    assert mixed, "no step mixed a prefill chunk with a decode"
    # logits only for the chunk that reaches the end of the prompt
    prompt_flags = [i.need_logits for s in steps for i in s if i.seq is long and not i.is_decode]
    assert prompt_flags[-1] and not any(prompt_flags[:-1])


def test_preemption_under_a_tiny_pool_finishes_everything_without_deadlock():
    bm = BlockManager(num_blocks=8, block_size=BS)    # 32 token slots in total
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq([i] * 6, f"r{i}", max_tokens=12) for i in range(6)]  # 18 tokens = 5 blocks each
    sched.add(seqs)
    finished, _ = run_to_completion(sched)
    assert len(finished) == 6
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 12 for s in seqs)
    # recompute kept the generated tokens: outputs are exactly 1000..1011 for everyone
    assert all(s.output_token_ids == list(range(1000, 1012)) for s in seqs)
    assert bm.num_used_blocks == 0


def test_preemption_takes_the_newest_sequence():
    bm = BlockManager(num_blocks=4, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old = make_seq([1, 2, 3, 4, 5, 6, 7], "old", max_tokens=8)
    new = make_seq([9, 9, 9, 9, 9, 9, 9], "new", max_tokens=8)
    sched.add([old, new])
    preempted = []

    def watch(items):
        for seq in (old, new):
            if seq.num_preemptions and seq.request_id not in preempted:
                preempted.append(seq.request_id)
    run_to_completion(sched, on_step=watch)
    assert preempted and preempted[0] == "new"
    assert old.num_preemptions == 0


def test_head_of_queue_is_not_starved_by_smaller_requests_behind_it():
    bm = BlockManager(num_blocks=10, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_seq(range(28), "first", max_tokens=12)     # 7..10 blocks while it runs
    big = make_seq(range(100, 124), "big", max_tokens=4)    # needs 6 blocks to start: must wait
    smalls = [make_seq([200 + i], f"s{i}", max_tokens=2) for i in range(20)]  # 1 block each
    sched.add([first, big] + smalls)
    admitted_at = {}

    def record(items):
        for item in items:
            admitted_at.setdefault(item.seq.request_id, len(admitted_at_steps))
        admitted_at_steps.append(items)
    admitted_at_steps = []
    finished, _ = run_to_completion(sched, on_step=record)
    assert len(finished) == 22
    # small requests fit beside "first" but must not jump ahead of the waiting "big"
    assert admitted_at["big"] > admitted_at["first"]
    assert admitted_at["big"] <= min(admitted_at[s.request_id] for s in smalls)


def test_offline_order_admits_a_leader_then_followers_hit_its_blocks():
    bm = BlockManager(num_blocks=200, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=256)
    system = list(range(1, 13))                               # 3 full shared blocks
    other = list(range(50, 62))
    group_a = [make_seq(system + [100 + i, 7], f"a{i}") for i in range(5)]
    group_b = [make_seq(other + [300 + i, 7], f"b{i}") for i in range(5)]
    interleaved = [s for pair in zip(group_a, group_b) for s in pair]
    sched.add(interleaved, offline=True)
    assert [s.request_id[0] for s in sched.waiting] == ["a"] * 5 + ["b"] * 5
    first_step = sched.schedule()
    admitted = [i.seq.request_id for i in first_step]
    assert admitted == ["a0", "b0"]                           # one leader per prefix group
    sched.complete_step(first_step)
    for item in first_step:
        item.seq.append_token(1, None)
    second_step = sched.schedule()
    followers = [i.seq for i in second_step if i.seq.request_id not in ("a0", "b0")]
    assert len(followers) == 8
    assert all(s.cached_prompt_tokens == 12 for s in followers)
    assert all(i.num_new_tokens == 2 for i in second_step if i.seq in followers)


def test_online_mode_keeps_arrival_order():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=256)
    seqs = [make_seq([9 - i, 1, 2], f"r{i}") for i in range(5)]
    sched.add(seqs, offline=False)
    assert [s.request_id for s in sched.waiting] == [f"r{i}" for i in range(5)]


def test_max_num_seqs_caps_running_sequences():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=100)
    sched.add([make_seq([i, i + 1], f"r{i}", max_tokens=3) for i in range(10)])
    items = sched.schedule()
    assert len(items) == 3 and len(sched.running) == 3
    assert all(s.status is SequenceStatus.WAITING for s in sched.waiting)


def test_finish_of_a_waiting_sequence_removes_it():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = make_seq([1, 2], "a"), make_seq([3, 4], "b")
    sched.add([a, b])
    sched.schedule()
    sched.finish(b)                                           # abort while waiting
    sched.finish(a)                                           # abort while running
    assert not sched.has_unfinished() and bm.num_used_blocks == 0

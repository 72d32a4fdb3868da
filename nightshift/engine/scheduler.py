"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has two budgets: at most `max_num_seqs` running sequences and at most
`max_num_batched_tokens` new tokens. Running sequences go first, oldest first: a
decoding sequence takes one token, a prefilling one takes the next chunk of its prompt
(chunked prefill, mixed with the decodes in the same step). Whatever budget is left
admits waiting sequences in queue order. When the KV pool runs out, the newest running
sequence is preempted: its blocks are freed (they stay in the prefix cache until
evicted) and it goes back to the head of the queue to be recomputed.

Prefix-aware admission: a waiting sequence whose next uncached prompt block is being
computed right now by a running sequence is held back for a step or two, so it hits
the cache instead of computing the same block twice. Together with the offline order
(requests sorted by prompt token ids, so prefix groups are contiguous) this admits one
leader per group first and its followers as soon as the shared blocks are cached.
Nobody starves: the queue head is never skipped for lack of blocks, and a held-back
sequence waits only on a running sequence that makes progress every step.

A request with n choices is admitted as one sequence that counts n against `max_num_seqs`; once
its prompt is computed, `fork` adds the other n - 1, sharing its prompt's blocks.

Sliding windows: with `window` (ModelConfig.kv_window: every layer of the model attends within
it), each step gives back the blocks of each sequence that lie wholly before the oldest position
its next query reads (num_computed_tokens - window + 1): a sequence then holds at most
ceil((window - 1 + chunk) / block_size) + 1 blocks, ceil(window / block_size) + 1 while decoding.
A sequence admitted on a cached prefix takes only the prefix's blocks its first query reads (the
earlier ones enter its table released), so a prompt longer than the pool runs, cached or not.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from nightshift.engine.block_manager import BlockManager
from nightshift.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start_pos: int        # tokens already in the KV cache
    num_new_tokens: int
    need_logits: bool     # this chunk reaches the sequence's last token: sample after it
    is_decode: bool       # one generated token (else a prompt chunk or a recompute)

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> "ScheduledSeq":
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens,
                   num_new_tokens == 1 and start >= seq.num_prompt_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 window: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, newest last
        self.num_preemptions = 0
        self.max_held_back_scan = 4 * max_num_seqs  # bounds the per-step admission scan
        self.window = window                         # every layer's attention span (None: some layer is global)
        self.num_released_blocks = 0                 # blocks given back out of the window, all steps

    # ---- queue -----------------------------------------------------------------
    def add(self, seqs: Iterable[Sequence], offline: bool = False) -> None:
        """Queue sequences. Offline: sorted by prompt token ids so prefix groups are adjacent."""
        seqs = list(seqs)
        if offline:
            seqs.sort(key=lambda s: s.token_ids)
        for seq in seqs:
            seq.status = SequenceStatus.WAITING
        self.waiting.extend(seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, parent: Sequence) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """The pending choices of `parent` (whose prompt was just computed) as sequences of their own,
        returned with the (source, destination) blocks whose K/V the runner must copy. Each shares
        the parent's full blocks and runs from the next step; if the pool has no block for a
        fork's copy of the partial last block, that fork waits at the queue head instead and
        recomputes its prompt (from the prefix cache) when admitted."""
        bm = self.block_manager
        children: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        for index in range(parent.choice_index + 1, parent.choice_index + 1 + parent.forks_pending):
            child = parent.fork(index)
            children.append(child)
            if bm.fork_cost(parent) <= bm.num_free_blocks:
                copy = bm.fork(parent, child)
                if copy is not None:
                    copies.append(copy)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                child.status = SequenceStatus.WAITING
                self.waiting.appendleft(child)
        parent.forks_pending = 0
        return children, copies

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ----------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate_slots(seq, n):
                victim = self.running.pop()  # newest first; never one already scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq.of(seq, n))
                budget -= n
                i += 1

        if not preempted:
            budget = self._admit(scheduled, budget)
        return scheduled

    def _pending_block_hashes(self) -> set[int]:
        """Hashes of full prompt blocks that running sequences have allocated but not finished."""
        pending: set[int] = set()
        for seq in self.running:
            self._add_pending(seq, pending)
        return pending

    def _add_pending(self, seq: Sequence, pending: set[int]) -> None:
        full = (seq.num_tokens - 1) // self.block_manager.block_size
        if seq.num_registered_blocks < full:
            pending.update(self.block_manager.block_hashes(seq, full)[seq.num_registered_blocks:])

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        bm = self.block_manager
        if not self.waiting:
            return budget
        caching = bm.enable_prefix_caching
        pending = self._pending_block_hashes() if caching else set()
        held_back: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.running and len(self.running) + 1 + seq.forks_pending > self.max_num_seqs:
                break   # room for all of its choices first
            matched = bm.match_prefix(seq)
            if caching and bm.first_missing_block_hash(seq, len(matched)) in pending:
                held_back.append(self.waiting.popleft())
                if len(held_back) >= self.max_held_back_scan:
                    break
                continue
            n = min(seq.num_tokens - len(matched) * bm.block_size, budget)
            skip = self._out_of_window(len(matched) * bm.block_size)
            if bm.admission_cost(matched, seq, n, skip) + seq.forks_pending > bm.num_free_blocks:
                break  # the head waits for blocks; nobody behind it jumps ahead
            cached = bm.allocate_prefix(seq, matched, skip)
            if seq.cached_prompt_tokens is None:
                seq.cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
            allocated = bm.allocate_slots(seq, n)
            assert allocated, "admission_cost promised enough free blocks"
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
            if caching:
                self._add_pending(seq, pending)
        self.waiting.extendleft(reversed(held_back))
        return budget

    def _out_of_window(self, first_position: int) -> int:
        """Leading blocks wholly before the oldest position a query at `first_position` reads
        (0 without a window): a cached prefix's blocks the sequence never needs to hold."""
        if self.window is None:
            return 0
        return max(0, first_position - self.window + 1) // self.block_manager.block_size

    def complete_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Advance each scheduled sequence past the tokens it just computed (registering its full
        blocks in the prefix cache, then giving back those out of the window, if the model has one)."""
        bm = self.block_manager
        for item in scheduled:
            item.seq.num_computed_tokens = item.start_pos + item.num_new_tokens
            bm.register_computed_blocks(item.seq)
            if self.window is not None:
                self.num_released_blocks += bm.release_before(item.seq, item.seq.num_computed_tokens - self.window + 1)

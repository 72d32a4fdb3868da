"""One choice of a request inside the engine: its tokens, KV block table and progress.

The scheduler moves a Sequence between WAITING, RUNNING and FINISHED; the block
manager fills `block_table`; the engine appends sampled tokens and checks stops.
A request with n choices starts as one sequence (choice 0); when its prompt is computed the
engine forks n - 1 more (`fork`), which share the prompt's KV blocks.
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from nightshift.engine.types import GenerationRequest, RequestError, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: GenerationRequest, block_size: int, choice_index: int = 0):
        self.request = request
        self.request_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.choice_index = choice_index
        # choices still to fork from this one once its prompt is computed (choice 0 of n only)
        self.forks_pending = request.sampling.n - 1 if choice_index == 0 else 0

        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(self.token_ids)
        # tokens whose K/V are in the cache (cached prefix + computed); the rest run next
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # chained hashes of this sequence's full blocks (index i covers tokens of block i)
        self.block_hashes: list[int] = []
        # leading blocks of block_table already registered in the prefix cache
        self.num_registered_blocks = 0
        # leading entries of block_table given back (BlockManager.RELEASED): out of every layer's
        # window, their positions are never read again (models whose layers all slide)
        self.num_released_blocks = 0
        # prefix-cache hit of the first admission (a recompute after preemption is our cost,
        # not a cache benefit to report)
        self.cached_prompt_tokens: Optional[int] = None
        self.num_preemptions = 0

        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.generator: Optional[torch.Generator] = None
        if self.sampling.seed is not None:   # choice i draws from seed + i
            self.generator = torch.Generator().manual_seed(int(self.sampling.seed) + choice_index)
        self.matcher = None     # the grammar matcher of a constrained request (engine/grammar.py)

        # the output text so far, and where incremental detokenisation stands in the output
        # tokens (stop_checker.detokenize_incrementally; only requests with stop strings use it)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

        self.finish_reason: Optional[str] = None
        self.stop_string: Optional[str] = None       # the stop string that ended it, if one did
        self.error: Optional[RequestError] = None     # a request ended by an error while it ran
        self.first_token_time: Optional[float] = None
        self.engine_seconds = 0.0

    # ---- token views -------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size:(index + 1) * self.block_size]

    def append_token(self, token_id: int, logprob: Optional[float],
                     top_logprobs: Optional[list[tuple[int, float]]] = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def fork(self, choice_index: int) -> "Sequence":
        """Choice `choice_index` of this sequence's request, at the same point: the same tokens and
        computed prefix and a copy of its grammar state. Blocks are the block manager's to give
        (BlockManager.fork); until then the fork holds none and nothing is computed."""
        child = Sequence(self.request, self.block_size, choice_index)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.cached_prompt_tokens = self.cached_prompt_tokens
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        return child

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


class SequenceGroup:
    """A request's choices: choice 0 from admission, the other n - 1 once forked from it."""

    def __init__(self, first: Sequence):
        self.request_id = first.request_id
        self.n = first.sampling.n
        self.seqs: list[Sequence] = [first]

    @property
    def finished(self) -> bool:
        return all(seq.status is SequenceStatus.FINISHED for seq in self.seqs) and \
            (len(self.seqs) == self.n or any(seq.finish_reason in ("abort", "error") for seq in self.seqs))

"""StepItem: one scheduled sequence's share of a model step, as the runner and the attention
backends see it (token ids, where they go in the KV pool), without the Sequence behind it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class StepItem:
    token_ids: list[int]          # new tokens of this sequence to process this step
    start_pos: int                # tokens of this sequence already in the KV cache
    block_table: list[int]        # KV blocks of the sequence, in position order
    need_logits: bool = True      # return logits for the last new token


def is_decode(item: StepItem) -> bool:
    """One new token after at least one cached one: a decode row (else a prefill chunk)."""
    return len(item.token_ids) == 1 and item.start_pos > 0


def decode_indices(items: Sequence[StepItem]) -> list[int]:
    """Indices of the decode items, in item order."""
    return [i for i, item in enumerate(items) if is_decode(item)]

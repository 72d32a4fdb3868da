"""What every attention backend provides, and the metadata fields they all share.

A backend turns one step's scheduled items into its own metadata (`build_metadata`: the order of
the items' rows in the flat batch, the pool slot of every new token, and whatever its attention
reads), then, in every layer, writes the new K/V into the pool (`store_kv`) and attends
(`forward`). The runner only flattens tokens in the order the metadata gives; the model only
calls `store_kv` and `forward`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from nightshift.engine.model_config import ModelConfig
from nightshift.engine.step import StepItem


@dataclass
class StepMetadata:
    item_order: list[int]          # item indices in the row order of the flat batch
    slot_mapping: torch.Tensor     # [T] int64: where each new token's K/V is written, in row order


@dataclass
class SequenceRows:
    """One sequence's new tokens, rows [row_start, row_end) of the flat batch at positions
    start_pos.., and the pool slots of all its positions so far (`[start_pos + n]`): what the
    masked attention path (sliding windows, soft-capping; torch_paged.masked_attention) reads."""
    row_start: int
    row_end: int
    start_pos: int
    context_slots: torch.Tensor


def sequence_rows(items: Sequence[StepItem], item_order: list[int], block_size: int,
                  device: torch.device) -> list[SequenceRows]:
    """Every item's SequenceRows, in the row order `item_order`."""
    rows, row = [], 0
    for i in item_order:
        item = items[i]
        n = len(item.token_ids)
        table = torch.tensor(item.block_table, dtype=torch.long)
        slots = pool_slots(table, torch.arange(item.start_pos + n), block_size)
        rows.append(SequenceRows(row, row + n, item.start_pos, slots.to(device)))
        row += n
    return rows


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)

    @abstractmethod
    def build_metadata(self, items: Sequence[StepItem]) -> StepMetadata:
        """The step's metadata from its scheduled items (checked by the runner beforehand)."""

    @abstractmethod
    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: StepMetadata) -> None:
        """Write the step's new k, v `[T, kv_heads, head_dim]` (rows in metadata order) into the pool."""

    def rope_store(self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                   num_heads: int) -> Optional[torch.Tensor]:
        """RoPE of the step's q and k heads `qk` `[T, num_heads + kv_heads, D]` and the store of k
        and `v` in one fused pass, giving q `[T, num_heads, D]` with exactly the values of
        ``models.llama.apply_rope`` then ``store_kv``; None where this backend has no such pass for
        these tensors (the model then runs those two steps itself)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: StepMetadata, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        """Attention of the flat batch q `[T, H, D]` (its k, v already stored) -> `[T, H, D]`.
        window: each query sees only the last `window` positions (itself included); softcap:
        scores (after `scale`) become softcap * tanh(scores / softcap). Both are set only by
        models whose config `needs_masked_attention`; a backend that cannot honour them raises."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, dtype={self.dtype}, device={self.device})"


def padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables `[len(tables), longest]` int64, zero-padded (padding is never read)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def pool_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots of `positions` given block tables (`tables` [B, nb] with positions [B, L],
    or one table [nb] with positions [L])."""
    blocks = torch.gather(tables, -1, positions // block_size)
    return blocks * block_size + positions % block_size

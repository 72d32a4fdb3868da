"""The padding-free batch layout and attention over it.

A step's sequences are concatenated into one `[T, ...]` tensor (no padding anywhere in the
linear layers, which are almost all of the work). Attention is per sequence; `VarlenBatch`
holds what every layer needs for it, computed once per step:

- `cu_seqlens` `[B + 1]`: sequence i owns rows `cu_seqlens[i]:cu_seqlens[i+1]`;
- `positions` `[T]`: each token's position in its sequence;
- `groups`: runs of consecutive sequences of one length, as (first row, count, length).

`grouped_attention` (the default) runs one scaled_dot_product_attention per group, on a view of
the step's rows (no copy in, no padding, no mask): the engine sorts a step's sequences by
length, so a step holds a few such runs (4.2 on average for bench/embeddings.py's 2,000 texts).
Measured there, one thread, all 65 steps of a layer (`python -m bench.embeddings --attention`
compares them end to end): grouped 0.71 s, one padded `[B, longest]` grid with a key mask
(`padded_attention`: scatter in, gather out) 0.79 s, one call per sequence
(`per_sequence_attention`, ~30 us of dispatch per call) 1.46 s; a block-diagonal mask over all
T tokens (T^2 work) took 10x the padded grid's time on a subset and is not kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VarlenBatch:
    cu_seqlens: torch.Tensor          # int64 [B + 1]
    lengths: list[int]
    positions: torch.Tensor           # int64 [T]
    groups: list[tuple[int, int, int]]  # (first row, sequences, length) of each run of equal lengths

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @classmethod
    def build(cls, lengths: list[int], device: torch.device | str = "cpu") -> "VarlenBatch":
        if not lengths or min(lengths) < 1:
            raise ValueError("a step needs at least one sequence, each of at least one token")
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lens)
        groups: list[tuple[int, int, int]] = []
        row = 0
        for length in lengths:
            if groups and groups[-1][2] == length:
                start, count, _ = groups[-1]
                groups[-1] = (start, count + 1, length)
            else:
                groups.append((row, 1, length))
            row += length
        return cls(cu.to(device), list(lengths), positions.to(device), groups)


def _split(qkv: torch.Tensor, count: int, length: int, num_heads: int):  # noqa: ANN202
    """q, k, v `[count, heads, length, head_dim]` views of `count * length` rows of q|k|v."""
    head_dim = qkv.shape[1] // (3 * num_heads)
    grid = qkv.view(count, length, 3, num_heads, head_dim)
    return (grid[:, :, i].transpose(1, 2) for i in range(3))


def _merge(out: torch.Tensor) -> torch.Tensor:
    """`[count, heads, length, head_dim]` -> `[count * length, hidden]`."""
    count, heads, length, head_dim = out.shape
    return out.transpose(1, 2).reshape(count * length, heads * head_dim)


def grouped_attention(qkv: torch.Tensor, batch: VarlenBatch, num_heads: int) -> torch.Tensor:
    """Bidirectional attention of each sequence over itself. qkv `[T, 3 * H]` (q, k, v side by
    side, each head-major) -> `[T, H]`."""
    outs = [_merge(F.scaled_dot_product_attention(*_split(qkv[start:start + count * length], count, length,
                                                           num_heads)))
            for start, count, length in batch.groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def padded_attention(qkv: torch.Tensor, batch: VarlenBatch, num_heads: int) -> torch.Tensor:
    """The same result through one `[B, longest]` grid with a key-padding mask (for comparison)."""
    b, max_len, width = batch.num_seqs, batch.max_len, qkv.shape[1]
    lens = torch.tensor(batch.lengths, device=qkv.device)
    seq = torch.repeat_interleave(torch.arange(b, device=qkv.device), lens)
    grid_index = seq * max_len + batch.positions
    # padding rows stay zero: masked out as keys, and their query rows are never read back
    grid = qkv.new_zeros(b * max_len, width).index_copy_(0, grid_index, qkv)
    key_mask = (torch.arange(max_len, device=qkv.device) < lens.unsqueeze(1)).view(b, 1, 1, max_len)
    out = F.scaled_dot_product_attention(*_split(grid, b, max_len, num_heads), attn_mask=key_mask)
    return _merge(out).index_select(0, grid_index)


def per_sequence_attention(qkv: torch.Tensor, batch: VarlenBatch, num_heads: int) -> torch.Tensor:
    """The same result, one SDPA call per sequence (for comparison)."""
    cu = batch.cu_seqlens.tolist()
    return torch.cat([_merge(F.scaled_dot_product_attention(*_split(qkv[start:end], 1, end - start, num_heads)))
                      for start, end in zip(cu[:-1], cu[1:])])


ATTENTION = {"grouped": grouped_attention, "padded": padded_attention, "per_sequence": per_sequence_attention}

"""Paged attention in plain torch: the KV-store step and attention over a sequence's blocks.

KV pool per layer: k_cache, v_cache `[num_blocks, block_size, kv_heads, head_dim]`; token at
position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`
of the flattened pool. Attention only ever reads a sequence's valid positions (gathered by slot
index) and never repeats K/V per query head: the query heads that share a KV head are folded
into the query dimension instead. The CUDA/Triton path plugs in by replacing these functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A sequence with several new tokens: rows [row_start, row_end) of the flat batch."""
    row_start: int
    row_end: int
    start_pos: int                          # tokens already in the cache before this step
    context_slots: Optional[torch.Tensor]   # [start_pos + n] slots of every position; None if start_pos == 0
    mask: Optional[torch.Tensor]            # [n, start_pos + n] bool causal mask; None if start_pos == 0


@dataclass
class DecodeGroup:
    """Sequences with one new token each and the same context length: rows [row_start, row_end)."""
    row_start: int
    row_end: int
    slots: torch.Tensor                     # [B, L] slots of every position (padding rows: any valid slot)
    mask: Optional[torch.Tensor] = None     # [B, 1, 1, L] bool, True = attend; None when all lengths are L


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor              # [T] where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)   # rows first in the batch
    prefills: list[PrefillSpan] = field(default_factory=list)        # then these, in row order


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V `[T, kv_heads, head_dim]` into the pool at `slot_mapping` `[T]`."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache positions `slots` (any shape S) -> `[*S, kv_heads, head_dim]`."""
    kv_heads, head_dim = cache.shape[-2:]
    # index_select, not cache[slots]: advanced indexing is ~10x slower on CPU here
    flat = cache.view(-1, kv_heads, head_dim).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, kv_heads, head_dim)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q `[B, n, H, D]` -> `[B, kv_heads, n * group, D]`: the query heads of one KV head become
    extra query rows (ordered position-major), so attention needs no repeated K/V."""
    batch, n, heads, dim = q.shape
    group = heads // kv_heads
    return q.view(batch, n, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * group, dim)


def _ungrouped(out: torch.Tensor, n: int, heads: int) -> torch.Tensor:
    """inverse of `_grouped`: `[B, kv_heads, n * group, D]` -> `[B, n, H, D]`."""
    batch, kv_heads, _, dim = out.shape
    return out.view(batch, kv_heads, n, heads // kv_heads, dim).permute(0, 2, 1, 3, 4).reshape(batch, n, heads, dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     scale: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q `[B, H, D]` (one new token per sequence, its K/V already stored), slots `[B, L]`
    -> `[B, H, D]`: each query attends to the L positions of its own sequence (those `mask`
    `[B, 1, 1, L]` allows, when sequences of different lengths share a call)."""
    batch, heads, _ = q.shape
    keys = gather_kv(k_cache, slots).transpose(1, 2)      # [B, kv_heads, L, D]
    values = gather_kv(v_cache, slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(_grouped(q.unsqueeze(1), keys.shape[1]), keys, values,
                                         attn_mask=mask, scale=scale)
    return _ungrouped(out, 1, heads).squeeze(1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """q `[n, H, D]`, the span's new k/v `[n, kv_heads, D]` -> `[n, H, D]`, causal over the
    cached prefix (start_pos tokens, read from the pool) plus the new tokens."""
    n, heads, _ = q.shape
    if span.context_slots is None:  # nothing cached: attend to the new K/V directly
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    keys = gather_kv(k_cache, span.context_slots).transpose(0, 1).unsqueeze(0)   # [1, kv_heads, L, D]
    values = gather_kv(v_cache, span.context_slots).transpose(0, 1).unsqueeze(0)
    group = heads // keys.shape[1]
    mask = span.mask.repeat_interleave(group, dim=0) if group > 1 else span.mask
    out = F.scaled_dot_product_attention(_grouped(q.unsqueeze(0), keys.shape[1]), keys, values,
                                         attn_mask=mask, scale=scale)
    return _ungrouped(out, n, heads).squeeze(0)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a whole flat batch `q [T, H, D]` (new k/v `[T, kv_heads, D]` already stored)."""
    outputs = [decode_attention(q[g.row_start:g.row_end], k_cache, v_cache, g.slots, scale, g.mask)
               for g in meta.decode_groups]
    outputs += [prefill_attention(q[s.row_start:s.row_end], k[s.row_start:s.row_end], v[s.row_start:s.row_end],
                                  k_cache, v_cache, s, scale) for s in meta.prefills]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

"""Plain-torch references for the Triton kernels: simple per-sequence loops, float32 math.

These define what the kernels compute; tests compare the kernels against them.
"""
from __future__ import annotations

import torch


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Row t of k/v `[T, kv_heads, D]` goes to flat pool slot `slot_mapping[t]`; a negative slot
    (padding) writes nothing."""
    kv_heads, head_dim = k_cache.shape[-2:]
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = k[t].to(k_cache.dtype)
            flat_v[slot] = v[t].to(v_cache.dtype)


def gather_positions(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence: `[length, kv_heads, D]`."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table.to(cache.device)[positions // block_size]
    return cache[blocks, positions % block_size]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q `[n, H, D]` at `query_positions` `[n]` against keys/values `[L, kv_heads, D]` (positions
    0..L-1), causal: a query sees positions <= its own. Float32 result `[n, H, D]`."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    group = heads // kv_heads
    keys = keys.float().repeat_interleave(group, dim=1)        # [L, H, D]
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= query_positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[B, H, D]`: sequence b's one new token (position context_lens[b] - 1, its K/V already in
    the pool) attends to positions 0..context_lens[b]-1. Returns `[B, H, D]` in q's dtype."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        keys = gather_positions(k_cache, block_tables[b], length)
        values = gather_positions(v_cache, block_tables[b], length)
        position = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b:b + 1], keys, values, position, scale)[0].to(q.dtype)
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[T, H, D]`: sequence s owns rows query_start_loc[s]..query_start_loc[s+1]-1, its last
    n_s tokens, at positions context_lens[s]-n_s .. context_lens[s]-1 (all K/V already in the
    pool, the earlier positions from previous steps or the prefix cache). Causal attention."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, length in enumerate(context_lens.tolist()):
        first, last = starts[s], starts[s + 1]
        n = last - first
        keys = gather_positions(k_cache, block_tables[s], length)
        values = gather_positions(v_cache, block_tables[s], length)
        positions = torch.arange(length - n, length, device=q.device)
        out[first:last] = _attend(q[first:last], keys, values, positions, scale).to(q.dtype)
    return out

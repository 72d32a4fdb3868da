"""Paged attention in plain torch: the row layout of a step, and attention over K/V gathered from
the pool (engine/kv_cache.py for the pool's layout).

Attention only ever reads a sequence's valid positions (gathered by slot index) and never repeats
K/V per query head: the query heads that share a KV head are folded into the query dimension
instead.

Decode batches whose sequences share leading KV blocks (a common system prompt, via the prefix
cache) use cascade attention: the shared prefix is read once for all queries, each sequence's own
suffix separately, and the two partial results are merged by their log-sum-exps. On CPU, reading
(gathering) K/V is what decode attention costs, so this roughly halves it on the benchmark workload.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    # additive causal mask (0 / -inf, model dtype) `[n * group, start_pos + n]`, rows ordered like
    # `_grouped` queries (position-major, `group` query heads per KV head); None if start_pos == 0
    mask: Optional[torch.Tensor]


@dataclass
class DecodeGroup:
    """Decode sequences attended in one call: rows [row_start, row_end) of the decode batch."""
    row_start: int
    row_end: int
    slots: torch.Tensor                     # [B, L] slots of the positions after the shared prefix
    mask: Optional[torch.Tensor] = None     # [B, 1, 1, L] additive float mask (0 / -inf); None: all valid


@dataclass
class DecodeBatch:
    """Decode sequences (one new token each) at rows [row_start, row_end) of the flat batch, sorted
    by context length. `prefix_slots`: positions 0..P-1, the same blocks for every sequence here."""
    row_start: int
    row_end: int
    groups: list[DecodeGroup]                      # rows relative to row_start
    prefix_slots: Optional[torch.Tensor] = None    # [P], P < every sequence's length


def index_copy_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new K/V `[T, kv_heads, head_dim]` into the pool at `slot_mapping` `[T]`."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache positions `slots` (any shape S) -> `[*S, kv_heads, head_dim]` in `dtype` (the
    queries': a pool may hold K/V narrower than the model computes, see ModelRunner)."""
    kv_heads, head_dim = cache.shape[-2:]
    # index_select, not cache[slots]: advanced indexing is ~10x slower on CPU here
    flat = cache.view(-1, kv_heads, head_dim).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, kv_heads, head_dim).to(dtype)


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


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention `[B, h, M, D]` and its log-sum-exp `[B, h, M]` (for merging partial results).
    mask: additive float, broadcastable to `[B, h, M, L]`."""
    if q.device.type == "cpu":  # torch's fused CPU kernel returns the log-sum-exp too
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        return out, lse
    return attention_with_lse_math(q, k, v, mask, scale)


def attention_with_lse_math(q, k, v, mask, scale):
    """`attention_with_lse` in plain matmuls (any device)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores.float(), dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype)), v), lse


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                     scale: float) -> torch.Tensor:
    """q `[B, H, D]` (one new token per sequence, its K/V already stored) -> `[B, H, D]`: each
    query attends to every position of its own sequence."""
    size, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    qg = _grouped(q.unsqueeze(1), kv_heads)                 # [B, kv_heads, group, D]
    group = qg.shape[2]
    if batch.prefix_slots is None:
        outs = []
        for g in batch.groups:
            keys = gather_kv(k_cache, g.slots, q.dtype).transpose(1, 2)   # [b, kv_heads, L, D]
            values = gather_kv(v_cache, g.slots, q.dtype).transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(qg[g.row_start:g.row_end], keys, values,
                                                       attn_mask=g.mask, scale=scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _ungrouped(out, 1, heads).squeeze(1)
    # shared prefix: every query of the batch against the prefix's K/V, read once
    prefix_k = gather_kv(k_cache, batch.prefix_slots, q.dtype).transpose(0, 1).unsqueeze(0)   # [1, kv_heads, P, D]
    prefix_v = gather_kv(v_cache, batch.prefix_slots, q.dtype).transpose(0, 1).unsqueeze(0)
    q_all = qg.transpose(0, 1).reshape(1, kv_heads, size * group, dim)
    out_p, lse_p = attention_with_lse(q_all, prefix_k, prefix_v, None, scale)
    out_p = out_p.view(kv_heads, size, group, dim).transpose(0, 1)
    lse_p = lse_p.view(kv_heads, size, group).transpose(0, 1)
    # each sequence's own positions after the prefix
    outs, lses = [], []
    for g in batch.groups:
        keys = gather_kv(k_cache, g.slots, q.dtype).transpose(1, 2)
        values = gather_kv(v_cache, g.slots, q.dtype).transpose(1, 2)
        out_s, lse_s = attention_with_lse(qg[g.row_start:g.row_end], keys, values, g.mask, scale)
        outs.append(out_s)
        lses.append(lse_s)
    out_s = outs[0] if len(outs) == 1 else torch.cat(outs)
    lse_s = lses[0] if len(lses) == 1 else torch.cat(lses)
    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p * torch.exp(lse_p - lse).unsqueeze(-1).to(out_p.dtype) + \
        out_s * torch.exp(lse_s - lse).unsqueeze(-1).to(out_s.dtype)
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
    keys = gather_kv(k_cache, span.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)   # [1, kv_heads, L, D]
    values = gather_kv(v_cache, span.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(_grouped(q.unsqueeze(0), keys.shape[1]), keys, values,
                                         attn_mask=span.mask, scale=scale)
    return _ungrouped(out, n, heads).squeeze(0)


def prefill_spans_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, spans: list[PrefillSpan], scale: float) -> list[torch.Tensor]:
    """`prefill_attention` of every span (rows of the flat batch), in span order."""
    return [prefill_attention(q[s.row_start:s.row_end], k[s.row_start:s.row_end], v[s.row_start:s.row_end],
                              k_cache, v_cache, s, scale) for s in spans]


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     sequences: Optional[list], scale: float, window: Optional[int],
                     softcap: Optional[float]) -> torch.Tensor:
    """Attention of the flat batch q `[T, H, D]` (its K/V already in the pool), one sequence
    (base.SequenceRows, in row order) at a time, causal and, with `window`, limited to the last
    `window` positions of each query (itself included, as transformers' sliding window); scores
    soft-capped as softcap * tanh(scores * scale / softcap) with `softcap`. Scores and softmax in
    float32, in plain matmuls (SDPA cannot soft-cap), on any device."""
    if sequences is None:
        raise ValueError("a sliding window or soft-capping needs the backend's masked path: it was built for a "
                         "model config without either (config.needs_masked_attention is False)")
    heads = q.shape[1]
    kv_heads = k_cache.shape[-2]
    group = heads // kv_heads
    outs = []
    for s in sequences:
        n = s.row_end - s.row_start
        end = s.start_pos + n
        first = 0 if window is None else max(0, s.start_pos - window + 1)    # oldest key any query sees
        slots = s.context_slots[first:end]
        keys = gather_kv(k_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)       # [1, kv_heads, L, D]
        values = gather_kv(v_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)
        qg = _grouped(q[s.row_start:s.row_end].unsqueeze(0), kv_heads)     # [1, kv_heads, n * group, D]
        q_pos = torch.arange(s.start_pos, end, device=q.device).repeat_interleave(group)[:, None]
        k_pos = torch.arange(first, end, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(values.dtype)
        outs.append(_ungrouped(torch.matmul(probs, values), n, heads).squeeze(0))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

"""Triton: prefill attention for chunks whose earlier tokens are already in the paged cache.

A flat varlen batch: sequence s owns query rows query_start_loc[s]..query_start_loc[s+1]-1, its
last n_s tokens, at positions context_lens[s]-n_s .. context_lens[s]-1. Their K/V are stored in
the pool first (store_kv), so the kernel reads every key from the pool through the block table:
the prefix-cache hit, an earlier chunk of a chunked prefill and the new tokens alike. Causal: a
query at position p sees positions 0..p.

One program per (tile of BLOCK_M query rows, sequence, query head); it walks the keys in tiles of
BLOCK_N up to the tile's last query position with an online softmax (flash-attention style).
Programs whose tile lies past their sequence's rows exit at once (the grid is sized by the
longest chunk).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nightshift.engine.kernels.decode_attention import dot_precision
from nightshift.engine.kernels.paged_tile import check_paged_inputs, load_kv_tile, online_softmax_step


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cp, stride_ch,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    first_row = tl.load(query_start_ptr + seq)
    num_rows = tl.load(query_start_ptr + seq + 1) - first_row
    if tile * BLOCK_M >= num_rows:
        return
    length = tl.load(context_lens_ptr + seq)
    prefix = length - num_rows
    kv_head = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (first_row + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + rows
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(length, prefix + (tile + 1) * BLOCK_M)    # one past the tile's last query position
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, p_mask, d, d_mask,
                            stride_bt, stride_cb, stride_cp, stride_ch, PAGE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale            # [BLOCK_M, BLOCK_N]
        visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out = acc / l_i[:, None]      # every real row sees position 0; padded rows see all of `end`
    tl.store(out_ptr + (first_row + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_query_len: Optional[int] = None, block_m: int = 64,
                            block_n: int = 64) -> torch.Tensor:
    """q `[T, H, D]` -> `[T, H, D]` (q's dtype); block_tables `[S, max_blocks]` int32,
    query_start_loc `[S + 1]` int32 (row offsets, query_start_loc[S] = T), context_lens `[S]`
    int32 (cached + new tokens). max_query_len: longest chunk if known on the host (else a sync)."""
    tokens, heads, head_dim = q.shape
    page, kv_heads = check_paged_inputs("prefill attention", q, k_cache, v_cache)
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"prefill attention: query_start_loc has {query_start_loc.shape[0]} entries "
                         f"for {num_seqs} sequences (needs {num_seqs + 1})")
    out = torch.empty_like(q)
    if tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype))
    return out

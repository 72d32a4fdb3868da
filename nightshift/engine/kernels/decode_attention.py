"""Triton: paged-attention decode for a batch of sequences of mixed lengths, with GQA.

Each sequence has one new query token (its K/V already stored) attending to its positions
0..context_lens[b]-1, read from the pool through its block table. One program handles one
(sequence, KV head, context partition): the GROUP query heads that share that KV head are the
rows of one `tl.dot` (padded to 16), so each K/V tile is read once for all of them. The context
is walked in tiles of BLOCK_N positions with an online softmax (running max and sum).

Split-KV ("flash decoding"): with few sequences the (sequence, KV head) grid leaves most SMs
idle, so the context is cut into partitions of `partition_size` positions (by default chosen from
the batch size: `choose_partition_size`), each program writes a partial output and its
log-sum-exp, and `merge_partitions` combines them. With one partition the kernel writes the
output directly.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from nightshift.engine.kernels.paged_tile import check_paged_inputs, load_kv_tile, online_softmax_step


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, block_tables_ptr, context_lens_ptr,
                   scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                   stride_bt, stride_cb, stride_cp, stride_ch,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, WRITE_LSE: tl.constexpr,
                   PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    length = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    begin = part * PARTITION
    end = tl.minimum(begin + PARTITION, length)
    for start in range(begin, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, p_mask, d, d_mask,
                            stride_bt, stride_cb, stride_cp, stride_ch, PAGE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale           # [BLOCK_G, BLOCK_N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    # an empty partition (past this sequence's end) leaves l_i = 0: write zeros and lse = -inf
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    o_ptrs = out_ptr + seq * stride_ob + part * stride_os + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + part, lse, mask=g_mask)


def merge_partitions(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """partial `[B, P, H, D]` float32 outputs of P context partitions, lse `[B, H, P]` their
    log-sum-exps (-inf for an empty partition) -> `[B, H, D]` float32, the attention over all."""
    weights = torch.softmax(lse, dim=-1)                        # [B, H, P]
    return torch.einsum("bhp,bphd->bhd", weights, partial)


def choose_partition_size(batch: int, kv_heads: int, max_context_len: int, block_n: int,
                          target_programs: int = 264, min_partition: int = 128) -> int:
    """Context positions per program: one partition (no merge) when batch x KV heads already
    gives `target_programs` (~2 per SM of an H100), else enough partitions to get there, none
    shorter than `min_partition` positions; always a multiple of block_n."""
    whole = triton.cdiv(max(max_context_len, 1), block_n) * block_n
    programs = batch * kv_heads
    if programs >= target_programs:
        return whole
    size = triton.cdiv(max_context_len, triton.cdiv(target_programs, programs))
    size = max(size, min_partition)
    return min(triton.cdiv(size, block_n) * block_n, whole)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact IEEE dots (not TF32), so float32 results match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           max_context_len: Optional[int] = None, partition_size: Optional[int] = None,
                           block_n: int = 32) -> torch.Tensor:
    """q `[B, H, D]` -> `[B, H, D]` (q's dtype). block_tables `[B, max_blocks]` int32 (entries past a
    sequence's blocks are ignored), context_lens `[B]` int32 (>= 1, including the new token).
    max_context_len: an upper bound of context_lens known on the host (sets how many partitions;
    None reads it from context_lens, a device sync). partition_size: context positions per program
    (split-KV); None chooses by batch size (choose_partition_size)."""
    batch, heads, head_dim = q.shape
    page, kv_heads = check_paged_inputs("decode attention", q, k_cache, v_cache)
    if partition_size is not None and partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    if batch == 0:
        return torch.empty_like(q)
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    if partition_size is None:
        partition_size = choose_partition_size(batch, kv_heads, max_context_len, block_n)
    group = heads // kv_heads
    partitions = triton.cdiv(max_context_len, partition_size)
    split = partitions > 1
    if split:
        out = torch.empty(batch, partitions, heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, heads, partitions, dtype=torch.float32, device=q.device)
    else:
        out = torch.empty(batch, 1, heads, head_dim, dtype=q.dtype, device=q.device)
        lse = out  # unused
    _decode_kernel[(batch, kv_heads, partitions)](
        q, k_cache, v_cache, out, lse, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(2), out.stride(1),
        lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page, BLOCK_N=block_n,
        PARTITION=partition_size, WRITE_LSE=split, PRECISION=dot_precision(q.dtype))
    if not split:
        return out[:, 0]
    return merge_partitions(out, lse).to(q.dtype)

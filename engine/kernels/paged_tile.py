"""Triton pieces shared by the paged-attention kernels (decode and prefill).

`load_kv_tile` reads the K and V of positions `pos` of one sequence and one KV head from the
paged pool through the sequence's block table; `online_softmax_step` folds one tile of scores
into the running max, sum and output (flash-attention's online softmax).
"""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, p_mask, d, d_mask,
                 stride_bt, stride_cb, stride_cp, stride_ch, PAGE: tl.constexpr):
    block = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=p_mask, other=0).to(tl.int64)
    row = block * stride_cb + (pos % PAGE) * stride_cp + kv_head * stride_ch
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """s `[ROWS, BLOCK_N]` scores (masked ones -inf), v `[BLOCK_N, BLOCK_D]` -> new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc

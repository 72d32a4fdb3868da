"""Triton pieces shared by the paged-attention kernels (decode and prefill).

`check_paged_inputs` validates q against the pool; `load_kv_tile` reads the K and V of positions
`pos` of one sequence and one KV head from the paged pool through the sequence's block table;
`online_softmax_step` folds one tile of scores into the running max, sum and output
(flash-attention's online softmax).
"""
import torch
import triton
import triton.language as tl


def check_paged_inputs(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(page size, KV heads) of the pool, after checking q `[rows, H, D]` fits it (ValueError naming `kernel`)."""
    heads, head_dim = q.shape[1:]
    _, page, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"{kernel}: q {tuple(q.shape)} does not fit a pool of {kv_heads} KV heads x {cache_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(2) != 1:
        raise ValueError(f"{kernel}: the pool must be contiguous and q's last dim dense")
    return page, kv_heads


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

"""Triton dequant-GEMM for our INT4 format (CUDA path of Int4Linear).

``y[M, N] = x[M, K] @ W.T`` with ``W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]`` read
straight from the packed uint8 ``[N, K/2]`` weight (engine/quant/format.py). Each program
owns a ``BLOCK_M x BLOCK_N`` tile of ``y`` and walks K in tiles of ``2 * BLOCK_KH`` channels:
it loads ``BLOCK_KH`` packed bytes per output row, splits them into the even (low nibble) and
odd (high nibble) channels, dequantizes both with the group's scale/min, and accumulates
``x_even @ w_even + x_odd @ w_odd`` in float32 (two ``tl.dot``s, so no nibble interleave).
float16 activations use a float16 dot; bfloat16 and float32 use a float32 dot (TF32 on
tensor cores): Triton's CPU interpreter computes bfloat16 dots wrongly, so that form could
not be verified here, and this form is exact to float32 against the reference.
Split-K over a third grid axis keeps the GPU busy when M is small (decode): partial sums are
added with an atomic float32 add.

Tested against the torch reference under ``TRITON_INTERPRET=1`` on CPU (tests/engine/quant/).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, M, N, K,
                      stride_xm, stride_xk, stride_qn, stride_sn, stride_ym,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KH: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_KH)
    half_k = K // 2
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(pid_k * BLOCK_KH, half_k, BLOCK_KH * SPLIT_K):
        j = j0 + rj                                   # packed byte index along K/2
        j_mask = j < half_k
        w_mask = j_mask[:, None] & n_mask[None, :]
        packed = tl.load(qw_ptr + rn[None, :] * stride_qn + j[:, None], mask=w_mask, other=0)
        group = (2 * j) // GROUP
        scale = tl.load(s_ptr + rn[None, :] * stride_sn + group[:, None], mask=w_mask, other=0.0)
        minimum = tl.load(m_ptr + rn[None, :] * stride_sn + group[:, None], mask=w_mask, other=0.0)
        scale = scale.to(tl.float32)
        minimum = minimum.to(tl.float32)
        w_even = (packed & 0xF).to(tl.float32) * scale + minimum     # [BLOCK_KH, BLOCK_N]
        w_odd = (packed >> 4).to(tl.float32) * scale + minimum
        x_mask = m_mask[:, None] & j_mask[None, :]
        x_row = x_ptr + rm[:, None] * stride_xm
        x_even = tl.load(x_row + (2 * j)[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_odd = tl.load(x_row + (2 * j + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
        if DOT_FP16:
            acc += tl.dot(x_even, w_even.to(tl.float16))
            acc += tl.dot(x_odd, w_odd.to(tl.float16))
        else:
            acc += tl.dot(x_even.to(tl.float32), w_even)
            acc += tl.dot(x_odd.to(tl.float32), w_odd)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def _split_k(m: int, n: int, half_k: int, block_n: int, block_kh: int) -> int:
    """Small M leaves few (M, N) tiles: split K until there are enough programs (~2 per SM of an
    H100-class GPU), never more splits than K tiles."""
    if m > 64:
        return 1
    tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(half_k, block_kh)
    split = 1
    while tiles * split < 264 and split * 2 <= k_tiles and split < 16:
        split *= 2
    return split


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, *, block_m: int | None = None, block_n: int = 64,
                block_kh: int = 32, split_k: int | None = None) -> torch.Tensor:
    """``x [M, K]`` (float16/bfloat16/float32) times the INT4 weight -> ``[M, N]`` in x's dtype."""
    if x.dim() != 2 or x.shape[1] != qweight.shape[1] * 2:
        raise ValueError(f"x must be [M, {qweight.shape[1] * 2}], got {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if block_m is None:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if split_k is None:
        split_k = _split_k(m, n, k // 2, block_n, block_kh)
    y = (torch.zeros if split_k > 1 else torch.empty)((m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _int4_gemm_kernel[grid](x, qweight, scales, mins, y, m, n, k,
                            x.stride(0), x.stride(1), qweight.stride(0), scales.stride(0), y.stride(0),
                            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KH=block_kh,
                            SPLIT_K=split_k, DOT_FP16=x.dtype == torch.float16)
    return y.to(x.dtype)

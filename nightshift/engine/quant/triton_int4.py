"""Triton kernels for our INT4 format (CUDA path of Int4Linear): three ways to compute ``x @ W.T``.

``W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]`` is read from the packed uint8 ``[N, K/2]``
weight (engine/quant/format.py: channel ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the
high one). Which of them (or torch's own int4 kernel) runs a call is measured per weight shape and
step size (engine/quant/int4_dispatch.py):

* ``int4_gemv``: one activation row (batch-1 decode), memory-bound. A program owns ``BLOCK_N``
  output channels and a ``1 / SPLIT_K`` share of K; it walks K one quantization group at a time
  (``BLOCK_K`` = the group, so one scale and one min per row per step), dequantizes in float32 and
  keeps a 2-D float32 accumulator reduced once at the end: no tensor cores, no per-step reduction.
* ``int4_tiled``: ``BLOCK_M x BLOCK_N`` output tiles of a ``tl.dot`` on the tensor cores (bfloat16
  or float16 operands, float32 accumulation), the weight tile dequantized in registers; split-K for
  small M (decode batches), where the (M, N) tiles alone are too few to fill the GPU.
* ``int4_dequantize`` + cuBLAS: the whole weight dequantized once per call into a scratch matrix of
  the activation dtype, then one dense matmul: for large M (prefill) the GEMM is compute-bound
  and cuBLAS's is the fastest there is; the dequantization is one memory-bound pass.

Split-K partial sums go to a ``[SPLIT_K, M, N]`` float32 buffer summed afterwards (deterministic,
unlike atomics: the same inputs give the same bits on every run). Nibbles become floats through
the exponent trick (``0x4B000000 | q`` read as a float is ``2**23 + q``), an integer OR and a
float subtraction instead of the conversion instruction, whose throughput is a sixteenth of the
FMA's on Hopper. Under Triton's CPU interpreter (the tests' TRITON_INTERPRET=1) the dots run in
float32: the interpreter computes bfloat16 dots wrongly.

Tested against the torch reference under ``TRITON_INTERPRET=1`` on CPU and compiled on CUDA
(tests/engine/quant/test_triton_int4.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)          # float32 bits of 2**23: OR-ing a nibble in gives 2**23 + nibble
MAGIC_FLOAT = tl.constexpr(8388608.0)


@triton.jit
def _nibbles(packed):
    """uint8 bytes -> (low nibble, high nibble) as float32, without int-to-float conversions."""
    word = packed.to(tl.int32)
    low = ((word & 0xF) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_FLOAT
    high = ((word >> 4) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_FLOAT
    return low, high


@triton.jit
def _load_group(qw_ptr, s_ptr, m_ptr, rn, n_mask, k0, stride_qn, stride_sn,
                BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """The K step at channel k0 of rows rn: (low nibbles, high nibbles) ``[rows, BLOCK_K / 2]`` and
    the step's scale and min per row (BLOCK_K divides GROUP: one group), all float32."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(qw_ptr + rn[:, None] * stride_qn + j[None, :], mask=n_mask[:, None], other=0)
    g = k0 // GROUP
    scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
    minimum = tl.load(m_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
    low, high = _nibbles(packed)
    return low, high, scale, minimum


@triton.jit
def _dequantized(low, high, scale, minimum):
    """``q * scale + min`` of both nibbles, interleaved back to channel order ``[rows, BLOCK_K]``."""
    return tl.interleave(low * scale[:, None] + minimum[:, None], high * scale[:, None] + minimum[:, None])


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_ys,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                      SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_K // 2)                  # packed bytes of one K step
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        low, high, scale, minimum = _load_group(qw_ptr, s_ptr, m_ptr, rn, n_mask, k0, stride_qn, stride_sn,
                                                BLOCK_K, GROUP)
        j = k0 // 2 + rj
        x_even = tl.load(x_ptr + 2 * j).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * j + 1).to(tl.float32)
        # sum_k (q s + m) x = s * sum_k q x + m * sum_k x, per row of the group
        acc += (low * x_even[None, :] + high * x_odd[None, :]) * scale[:, None]
        acc += minimum[:, None] * (x_even + x_odd)[None, :]
    y = tl.sum(acc, axis=1)
    y_ptrs = y_ptr + pid_k * stride_ys + rn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_tiled_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, M, N, K,
                       stride_xm, stride_qn, stride_sn, stride_ys, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FLOAT32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        low, high, scale, minimum = _load_group(qw_ptr, s_ptr, m_ptr, rn, n_mask, k0, stride_qn, stride_sn,
                                                BLOCK_K, GROUP)
        w = _dequantized(low, high, scale, minimum)                 # [BLOCK_N, BLOCK_K], channel order
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None], other=0.0)
        if DOT_FLOAT32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
    y_ptrs = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_dequantize_kernel(qw_ptr, s_ptr, m_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * BLOCK_K
    n_mask = rn < N
    low, high, scale, minimum = _load_group(qw_ptr, s_ptr, m_ptr, rn, n_mask, k0, stride_qn, stride_sn,
                                            BLOCK_K, GROUP)
    w = _dequantized(low, high, scale, minimum)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None] * stride_wn + rk[None, :], w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


@dataclass(frozen=True)
class KernelConfig:
    """One way to run a call: ``method`` "gemv", "tiled", "dequant" (this module's kernels) or
    "tinygemm" (torch's CUDA int4 kernel, engine/quant/int4_dispatch.py), and the launch parameters of
    ours. block_k divides the quantization group (a K step has one scale and min per row) and is at
    least 32: with 16 the tiled kernel computed wrong results on an H200 (Triton 3.6)."""
    method: str
    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.method not in ("gemv", "tiled", "dequant", "tinygemm"):
            raise ValueError(f"unknown INT4 method {self.method!r}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be at least 32, got {self.block_k}")

    def describe(self) -> str:
        if self.method == "dequant":
            return "dequant+cuBLAS"
        if self.method == "tinygemm":
            return "torch tinygemm"
        return (f"{self.method} m{self.block_m} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: torch.Tensor, qweight: torch.Tensor, group_size: int, config: KernelConfig) -> None:
    if x.dim() != 2 or x.shape[1] != qweight.shape[1] * 2:
        raise ValueError(f"x must be [M, {qweight.shape[1] * 2}], got {tuple(x.shape)}")
    if config.method != "dequant" and group_size % config.block_k:
        raise ValueError(f"block_k {config.block_k} must divide the group size {group_size}")


def _split_output(m: int, n: int, split_k: int, x: torch.Tensor) -> torch.Tensor:
    if split_k == 1:
        return torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    return torch.empty((split_k, m, n), device=x.device, dtype=torch.float32)


def _reduce(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y[0] if y.shape[0] == 1 else y.sum(dim=0).to(dtype)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int, config: KernelConfig) -> torch.Tensor:
    """``x [1, K]`` times the INT4 weight -> ``[1, N]`` in x's dtype."""
    _check(x, qweight, group_size, config)
    if x.shape[0] != 1:
        raise ValueError(f"int4_gemv takes one row, got {x.shape[0]}")
    x = x.contiguous()
    n, k = qweight.shape[0], x.shape[1]
    y = _split_output(1, n, config.split_k, x)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _int4_gemv_kernel[grid](x, qweight, scales, mins, y, n, k, qweight.stride(0), scales.stride(0), y.stride(0),
                            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP=group_size,
                            SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return _reduce(y, x.dtype)


def int4_tiled(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               group_size: int, config: KernelConfig) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight -> ``[M, N]`` in x's dtype, on tensor-core tiles."""
    _check(x, qweight, group_size, config)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = _split_output(m, n, config.split_k, x)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    _int4_tiled_kernel[grid](x, qweight, scales, mins, y, m, n, k, x.stride(0), qweight.stride(0),
                             scales.stride(0), y.stride(0), y.stride(1),
                             BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                             GROUP=group_size, SPLIT_K=config.split_k,
                             DOT_FLOAT32=x.dtype == torch.float32 or _interpreting(),
                             num_warps=config.num_warps, num_stages=config.num_stages)
    return _reduce(y, x.dtype)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    dtype: torch.dtype, block_n: int = 32) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype`` (each value ``q * scale + min`` in float32, then cast),
    one memory-bound pass on the GPU."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    w = torch.empty((n, k), device=qweight.device, dtype=dtype)
    block_k = min(group_size, 128)
    grid = (triton.cdiv(n, block_n), k // block_k)
    _int4_dequantize_kernel[grid](qweight, scales, mins, w, n, k, qweight.stride(0), scales.stride(0), w.stride(0),
                                  BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group_size)
    return w

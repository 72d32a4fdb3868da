"""Triton kernels for our INT4 format (CUDA path of Int4Linear): four ways to compute ``x @ W.T``.

``W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]`` is read from the packed uint8 ``[N, K/2]``
weight (engine/quant/format.py: channel ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the
high one). Which of them (or torch's own int4 kernel) runs a call is measured per weight shape and
step size (engine/quant/int4_dispatch.py):

* ``int4_gemv``: one activation row (batch-1 decode), memory-bound. A program owns ``BLOCK_N``
  output channels and every ``SPLIT_K``-th step of ``BLOCK_K`` channels (whole groups, several in
  flight per row); the weight is read as 32-bit words, the activation as ``[words, 8]`` blocks split
  into its 8 columns in registers, and per group ``sum (128 + q) x`` becomes the dot (below).
* ``int4_tiled``: ``BLOCK_M x BLOCK_N`` output tiles of ``tl.dot`` on the tensor cores (bfloat16
  or float16 operands, float32 accumulation); the weight tile is not dequantized: its nibbles become
  ``128 + q`` (bfloat16) or ``1024 + q`` (float16) by bit operations, exact in the dot's dtype, the
  even and odd channels are two dots against the activation tile's even and odd columns (loaded
  contiguously, split in registers), and the step's scale and min are applied to the partial tile.
  Split-K for small M (decode batches), where the (M, N) tiles alone are too few to fill the GPU.
* ``int4_swapped``: ``y^T = W x^T`` in ``BLOCK_N x BLOCK_M`` tiles, the swap-AB of Marlin and
  vLLM's small-batch GEMMs: the weight tile, made from its nibbles in registers (the nibbles
  interleaved back to channel order), is the dot's first operand, which the tensor cores read from
  registers, and the activation's transposed tile the second; a decode batch's rows are the
  product's small dimension (the tensor cores' N, 8-256) instead of padding a 64-row one. Either
  the bias trick (``exact``) or the weight dequantized in registers and rounded once to the dot's
  dtype, chained into one accumulator; split-K as above. On an H200 it is the fastest at 16-128
  rows on the 8B shapes and for the 28672-row gate_up up to 256.
* ``int4_dequantize`` + cuBLAS: the whole weight dequantized once per call into a scratch matrix of
  the activation dtype, then one dense matmul: for large M (prefill) the GEMM is compute-bound
  and cuBLAS's is the fastest there is; the dequantization is one memory-bound pass.

The bias trick: with ``q'`` = 128 + q (what the bits give without a conversion or subtraction),
``sum_k (q s + m) x = s * sum_k q' x + (m - 128 s) * sum_k x`` per group (1024 for float16); the
products are exact and the sums float32, so this costs nothing in accuracy that matters against the
output's rounding. Split-K partial sums go to a ``[SPLIT_K, M, N]`` float32 buffer summed afterwards
(deterministic, unlike atomics: the same inputs give the same bits on every run). The dequantization
kernel turns nibbles into floats through ``0x4B000000 | q`` read as a float (``2**23 + q``), an
integer OR and a float subtraction instead of the conversion instruction, whose throughput is a
sixteenth of the FMA's on Hopper. Under Triton's CPU interpreter (the tests' TRITON_INTERPRET=1)
the dots run in float32: the interpreter computes bfloat16 dots wrongly.

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
BIAS = tl.constexpr(128.0)                   # nibble q read as 128 + q (bfloat16 / float32 bit tricks)
BIAS_F32_BITS = tl.constexpr(0x43000000)     # float32 bits of 128.0; q << 16 lands on the unit bit
BIAS_BF16_BITS = tl.constexpr(0x4300)        # bfloat16 bits of 128.0; q lands on the unit bit
BIAS_F16 = tl.constexpr(1024.0)              # float16 bits 0x6400 = 1024.0, whose unit bit is bit 0
BIAS_F16_BITS = tl.constexpr(0x6400)


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
def _biased_f32(nibble):
    """uint32 nibbles q -> float32 ``128 + q`` exactly: ``q << 16 | bits(128.0)`` (no conversion op)."""
    return ((nibble << 16) | BIAS_F32_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _word_nibble_f32(words, I: tl.constexpr):
    """Nibble I of each uint32 word as float32 ``128 + q``: one shift that lands it on bits 16-19 and
    one mask-and-OR (a single LOP3) that adds the exponent of 128."""
    if I < 4:
        moved = words << (16 - 4 * I)
    elif I == 4:
        moved = words
    else:
        moved = words >> (4 * I - 16)
    return ((moved & 0xF0000) | BIAS_F32_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _columns8(xw, ROWS: tl.constexpr):
    """``[ROWS, 8]`` -> its 8 columns (each ``[ROWS]``), by splitting pairs in registers."""
    even, odd = tl.split(tl.reshape(xw, (ROWS, 4, 2)))            # columns 0 2 4 6 | 1 3 5 7
    c04, c26 = tl.split(tl.reshape(even, (ROWS, 2, 2)))
    c15, c37 = tl.split(tl.reshape(odd, (ROWS, 2, 2)))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_ys,
                      BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, SPLIT_K: tl.constexpr):
    """One activation row. A program owns BLOCK_N rows and every SPLIT_K-th step of GROUPS whole
    groups. The weight is read as 32-bit words (8 channels each: nibble i of word w is channel
    8w + i) and the activation as ``[words, 8]`` (16-byte loads, columns split in registers); each
    nibble becomes ``128 + q`` as a float by a shift and a mask-and-OR, so a weight costs two
    integer ops and one FMA; per group ``sum (128 + q) x`` is turned into the real dot as
    ``s * dot + (min - 128 s) * sum x``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    WORDS: tl.constexpr = GROUPS * GROUP // 8        # 32-bit words of one row per step
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, WORDS)
    rg = tl.arange(0, GROUPS)
    r8 = tl.arange(0, 8)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for k0 in range(pid_k * GROUPS * GROUP, K, GROUPS * GROUP * SPLIT_K):
        w = k0 // 8 + rw
        w_mask = w < K // 8
        words = tl.load(qw_ptr + rn[:, None] * stride_qn + w[None, :], mask=n_mask[:, None] & w_mask[None, :],
                        other=0).to(tl.uint32, bitcast=True)
        xw = tl.load(x_ptr + 8 * w[:, None] + r8[None, :], mask=w_mask[:, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns8(xw, WORDS)
        dots = _word_nibble_f32(words, 0) * x0[None, :]
        dots += _word_nibble_f32(words, 1) * x1[None, :]
        dots += _word_nibble_f32(words, 2) * x2[None, :]
        dots += _word_nibble_f32(words, 3) * x3[None, :]
        dots += _word_nibble_f32(words, 4) * x4[None, :]
        dots += _word_nibble_f32(words, 5) * x5[None, :]
        dots += _word_nibble_f32(words, 6) * x6[None, :]
        dots += _word_nibble_f32(words, 7) * x7[None, :]
        group_dots = tl.sum(tl.reshape(dots, (BLOCK_N, GROUPS, GROUP // 8)), axis=2)
        group_xsum = tl.sum(tl.reshape(xw, (GROUPS, GROUP)), axis=1)
        g = k0 // GROUP + rg
        meta_mask = n_mask[:, None] & (g < K // GROUP)[None, :]
        meta = rn[:, None] * stride_sn + g[None, :]
        scale = tl.load(s_ptr + meta, mask=meta_mask, other=0.0).to(tl.float32)
        minimum = tl.load(m_ptr + meta, mask=meta_mask, other=0.0).to(tl.float32)
        acc += group_dots * scale + (minimum - BIAS * scale) * group_xsum[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + pid_k * stride_ys + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _weight_tile(packed, scale, minimum, bias_bits, EXACT: tl.constexpr, DOT_FLOAT32: tl.constexpr,
                 DTYPE: tl.constexpr):
    """A tile of packed bytes -> (low-nibble tile, high-nibble tile), a tile kernel's weight operand:
    ``bias + q`` exactly (EXACT: scale and min applied to the step's partial sums) or ``q * s + min``
    rounded once to the dot's dtype (chained straight into the accumulator)."""
    if EXACT:
        if DOT_FLOAT32:
            word = packed.to(tl.uint32)
            low = _biased_f32(word & 0xF)
            high = _biased_f32(word >> 4)
        else:
            half = packed.to(tl.uint16)
            low = ((half & 0xF) | bias_bits).to(tl.uint16).to(DTYPE, bitcast=True)
            high = ((half >> 4) | bias_bits).to(tl.uint16).to(DTYPE, bitcast=True)
    else:
        low, high = _nibbles(packed)
        low = low * scale[:, None] + minimum[:, None]
        high = high * scale[:, None] + minimum[:, None]
        if not DOT_FLOAT32:
            low = low.to(DTYPE)
            high = high.to(DTYPE)
    return low, high


@triton.jit
def _int4_tiled_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, M, N, K,
                       stride_xm, stride_qn, stride_sn, stride_ys, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FLOAT32: tl.constexpr):
    """``BLOCK_M x BLOCK_N`` tiles on the tensor cores. The weight tile is not dequantized: its
    nibbles become ``128 + q`` in the dot's dtype by bit operations (bfloat16 ``0x4300 | q``, float16
    ``0x6400 | q`` = ``1024 + q``, float32 as in the GEMV), exact in every one; the even and odd
    channels are two dots against the activation's even and odd columns (no interleaving), and the
    step's scale and min are applied to the step's partial tile: ``s * dot + (min - bias s) sum x``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, BLOCK_K // 2)
    m_mask = rm < M
    n_mask = rn < N
    dtype = x_ptr.dtype.element_ty
    if dtype == tl.float16 and not DOT_FLOAT32:   # the bias trick's bits and value in the dot's dtype
        bias_bits = BIAS_F16_BITS
        bias = BIAS_F16
    else:
        bias_bits = BIAS_BF16_BITS
        bias = BIAS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        j = k0 // 2 + rj
        packed = tl.load(qw_ptr + rn[:, None] * stride_qn + j[None, :], mask=n_mask[:, None], other=0)
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_mask[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))   # contiguous load, split in registers
        g = k0 // GROUP
        scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        minimum = tl.load(m_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        low, high = _weight_tile(packed, scale, minimum, bias_bits, True, DOT_FLOAT32, dtype)
        if DOT_FLOAT32:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
            part = tl.dot(x_even, tl.trans(low), input_precision="ieee")
            part = tl.dot(x_odd, tl.trans(high), part, input_precision="ieee")
        else:
            part = tl.dot(x_even, tl.trans(low))
            part = tl.dot(x_odd, tl.trans(high), part)
        xsum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
        acc += part * scale[None, :] + xsum[:, None] * (minimum - bias * scale)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_swapped_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, M, N, K,
                         stride_xm, stride_qn, stride_sn, stride_ys, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr,
                         DOT_FLOAT32: tl.constexpr):
    """``y^T = W x^T`` in ``BLOCK_N x BLOCK_M`` tiles: the weight tile, made in registers from its
    nibbles, is the dot's first operand (which the tensor cores take from registers) and the
    activation's transposed tile the second, loaded straight into shared memory; the step's rows M
    are the small dimension of the product (the tensor cores' N, 8-256), as in Marlin and vLLM's
    swap-AB tiles. The nibbles are interleaved back to channel order in registers (each byte holds
    two neighbouring channels, which the operand's registers hold side by side) and the tile is one
    dot against the activation's contiguous ``[BLOCK_K, BLOCK_M]`` tile. EXACT: the bias trick of
    ``int4_tiled`` (scale and min applied to the step's partial tile, best at 16 rows on an H200);
    otherwise the weight dequantized in registers and chained into the accumulator (32 rows and
    up)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rj = tl.arange(0, BLOCK_K // 2)
    n_mask = rn < N
    m_mask = rm < M
    dtype = x_ptr.dtype.element_ty
    if dtype == tl.float16 and not DOT_FLOAT32:   # the bias trick's bits and value in the dot's dtype
        bias_bits = BIAS_F16_BITS
        bias = BIAS_F16
    else:
        bias_bits = BIAS_BF16_BITS
        bias = BIAS
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        packed = tl.load(qw_ptr + rn[:, None] * stride_qn + (k0 // 2 + rj)[None, :], mask=n_mask[:, None], other=0)
        g = k0 // GROUP
        scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        minimum = tl.load(m_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        low, high = _weight_tile(packed, scale, minimum, bias_bits, EXACT, DOT_FLOAT32, dtype)
        if EXACT:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            part = acc
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=m_mask[None, :], other=0.0)
        w = tl.interleave(low, high)
        if DOT_FLOAT32:
            part = tl.dot(w, x.to(tl.float32), part, input_precision="ieee")
        else:
            part = tl.dot(w, x, part)
        if EXACT:
            xsum = tl.sum(x.to(tl.float32), axis=0)
            acc += part * scale[:, None] + (minimum - bias * scale)[:, None] * xsum[None, :]
        else:
            acc = part
    y_ptrs = y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


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
    ours. block_k is the channels of one K step: for the tiled kernel a divisor of the quantization
    group (a step has one scale and min per row), for the GEMV whole groups; at least 32: with 16 the
    tiled kernel computed wrong results on an H200 (Triton 3.6)."""
    method: str
    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    exact: bool = True          # "swapped": the bias trick (else the weight dequantized in registers)

    def __post_init__(self) -> None:
        if self.method not in ("gemv", "tiled", "swapped", "dequant", "tinygemm"):
            raise ValueError(f"unknown INT4 method {self.method!r}")
        if self.block_k < 32:
            raise ValueError(f"block_k must be at least 32, got {self.block_k}")

    def describe(self) -> str:
        if self.method == "dequant":
            return "dequant+cuBLAS"
        if self.method == "tinygemm":
            return "torch tinygemm"
        form = ""
        if self.method == "swapped":
            form = " exact" if self.exact else " dequant"
        return (f"{self.method}{form} m{self.block_m} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(x: torch.Tensor, qweight: torch.Tensor, group_size: int, config: KernelConfig) -> None:
    if x.dim() != 2 or x.shape[1] != qweight.shape[1] * 2:
        raise ValueError(f"x must be [M, {qweight.shape[1] * 2}], got {tuple(x.shape)}")
    if config.method == "gemv" and config.block_k % group_size:
        raise ValueError(f"the GEMV's block_k {config.block_k} must be whole groups of {group_size}")
    if config.method in ("tiled", "swapped") and group_size % config.block_k:
        raise ValueError(f"block_k {config.block_k} must divide the group size {group_size}")


def _split_output(m: int, n: int, split_k: int, x: torch.Tensor) -> torch.Tensor:
    if split_k == 1:
        return torch.empty((1, m, n), device=x.device, dtype=x.dtype)
    return torch.empty((split_k, m, n), device=x.device, dtype=torch.float32)


def _reduce(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y[0] if y.shape[0] == 1 else y.sum(dim=0).to(dtype)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int, config: KernelConfig) -> torch.Tensor:
    """``x [1, K]`` times the INT4 weight -> ``[1, N]`` in x's dtype; ``config.block_k`` channels
    (whole groups) per step, the weight read as 32-bit words (K a multiple of 8)."""
    _check(x, qweight, group_size, config)
    if x.shape[0] != 1:
        raise ValueError(f"int4_gemv takes one row, got {x.shape[0]}")
    if qweight.shape[1] % 4 or qweight.stride(1) != 1 or qweight.stride(0) % 4:
        raise ValueError("int4_gemv reads 32-bit words: K must be a multiple of 8 and the rows contiguous")
    x = x.contiguous()
    n, k = qweight.shape[0], x.shape[1]
    words = qweight.view(torch.int32)
    y = _split_output(1, n, config.split_k, x)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _int4_gemv_kernel[grid](x, words, scales, mins, y, n, k, words.stride(0), scales.stride(0), y.stride(0),
                            BLOCK_N=config.block_n, GROUP=group_size, GROUPS=config.block_k // group_size,
                            SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return _reduce(y, x.dtype)


def _tiles(kernel, swapped: bool, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           mins: torch.Tensor, group_size: int, config: KernelConfig, **constants) -> torch.Tensor:
    """Launch a tensor-core tile kernel (its grid (M tiles, N tiles, split) or, swapped, (N tiles,
    M tiles, split)) and sum its split-K partials."""
    _check(x, qweight, group_size, config)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = _split_output(m, n, config.split_k, x)
    m_tiles, n_tiles = triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)
    grid = (n_tiles, m_tiles, config.split_k) if swapped else (m_tiles, n_tiles, config.split_k)
    kernel[grid](x, qweight, scales, mins, y, m, n, k, x.stride(0), qweight.stride(0),
                 scales.stride(0), y.stride(0), y.stride(1),
                 BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 GROUP=group_size, SPLIT_K=config.split_k,
                 DOT_FLOAT32=x.dtype == torch.float32 or _interpreting(),
                 num_warps=config.num_warps, num_stages=config.num_stages, **constants)
    return _reduce(y, x.dtype)


def int4_tiled(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               group_size: int, config: KernelConfig) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight -> ``[M, N]`` in x's dtype, on tensor-core tiles."""
    return _tiles(_int4_tiled_kernel, False, x, qweight, scales, mins, group_size, config)


def int4_swapped(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, config: KernelConfig) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight -> ``[M, N]`` in x's dtype, computed as ``(W x^T)^T`` on
    tensor-core tiles."""
    return _tiles(_int4_swapped_kernel, True, x, qweight, scales, mins, group_size, config, EXACT=config.exact)


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

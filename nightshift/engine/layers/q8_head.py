"""The LM head from a GGUF's own Q8_0 blocks, on the CPU: an INT4 model's small calls (half the
bytes of bf16), and every call of a model whose layers run on int8 activations or whose bf16 CPU
math measured this head faster.

A decode step of one to a few sequences is bound by reading weights, and the LM head is the
largest of them (SmolLM2's tied 49,152 x 576 embedding: 57 MB in bfloat16, 113 MB in float32, read
for every token). Where the checkpoint is a GGUF that stores that matrix as Q8_0 (int8 values with
one float16 scale per 32; the default model's file does), the float weights the engine holds are
exactly ``q * d``, so the head can read the int8 values and scales instead (30 MB) and lose
nothing: ``Q8Head.linear`` computes ``sum_b d[n, b] * sum_{k in b} q[n, k] * x[m, k]`` in float32,
the same products as the float32 head up to summation order, and closer to them than the bf16 CPU
math's head (bfloat16 weights and activations).

Which calls use it: an INT4 model's head calls of at most ``cpu_int4_max_rows`` rows (the rows
that need logits: every row of a small decode step, the last of each prompt a prefill step ends;
``LinearFactory.small_step_rows``, with the INT4 layers on the dense kernel: quant/int4_linear.py).
That model's layers already run another kernel for small steps than for larger ones, so a row's
logits already depend on the size of the step it falls in, and the head adds no dependence of a
new kind. Within a call every row is computed alone, the same operations whatever rows share it.

``linear_int8`` takes every head call, small and large, of two kinds of model: the same Q8_0
weights against the rows quantized to int8 per block of 32 (quant/cpu_w8a8.py: AVX-512 VNNI, or
AVX2), each row alone, one kernel for every step, so a row's logits never depend on its step.
(1) An INT4 model whose layers run the W4A8 kernel (int8 activations on every step:
quant/cpu_w4a8.py). (2) A full-precision model on the bf16 CPU math where
``cpu_math.choose_head`` measured it faster than the math's own head (or NIGHTSHIFT_CPU_HEAD=q8):
that head rounds weights and activations to bfloat16, this one keeps the GGUF's exact weights and
rounds the activations to int8 per block of 32; `bench.quality --maths bf16` on a 2-core Zen 4
(2026-11-28): top-1 0.9878, mean KL 7.26e-04, greedy equal 57.8% against the bf16 head's 0.9761 /
6.50e-04 / 46.9% (HF bfloat16: 0.9736 / 1.17e-03 / 39.1%), so it stays within the quality rule. At
a 256-row decode step the head is a fifth (the default model) to a quarter (W4A8) of the
multiply-adds; on that Zen 4, ad hoc, with the engine's allocator settings (engine/cpu_allocator.py:
without them each call's fresh 50 MB of float32 logits page-faults, 39-40 ms), 24.3-24.6 ms against
33.6-34.5 ms for the bf16 head (its bfloat16 logits), 22.4-22.5 ms since the kernel holds each
weight vector in a register for its four rows; in `bench.engine --skip-hf` runs the head calls took
3.20-3.23 s against 4.70-4.77 s. (On another Zen 4, 2026-11-27, 31-34 ms against 39-40 ms for the
bf16 head, which then gave float32 logits.)

An AVX-512 C kernel (OpenMP over groups of 16 output rows, held interleaved so a vector's lanes are
16 rows: no horizontal sums; each weight vector widened once for up to 8 of the step's rows), or
its AVX2 form (the same sums, each 16 rows as two vectors of 8, up to 2 rows a register tile),
built on first use through kernels/c_library.py; on CPUs with neither, or where it cannot build, the
dense head runs. One row of SmolLM2's head on a 2-core Zen 4 EPYC: 0.94-1.06 ms against 3.0 ms for
the bf16 CPU math's head (timed ad hoc); on a 2-core Zen 3 (AVX2) 1.9 ms a batch-1 token (wrapper
timings of `bench.quant_decode`'s decode) against the float32 head's 113 MB a row.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from nightshift.engine.cpu_features import cpu_flags
from nightshift.engine.kernels.c_library import OPTIMIZE, load_library
from nightshift.engine.layers.linear import GGUFBlocks
from nightshift.engine.quant import cpu_w8a8

Q8_0 = 8                # gguf.GGMLQuantizationType.Q8_0
BLOCK = 32
BLOCK_BYTES = 34        # float16 scale + 32 int8

SOURCE = r"""
#include <stdint.h>

#include <immintrin.h>

#ifdef __AVX512F__
/* y [M, N] float32 = x @ W.T (x [M, K] float32: a small step's rows), W the Q8_0 matrix held 16
   rows interleaved: q [Np/16, K, 16] int8 (column k of rows 16g..16g+15 contiguous), d [Np/16,
   K/32, 16] float32. The 16 lanes of a vector are a group's 16 output rows: per input channel one
   16-byte load widened to float, then for each row one multiply-add (two chains, even and odd
   channels), per block of 32 one multiply-add by the 16 rows' scales; no horizontal sums. Up to 8
   rows share each widened weight vector (a register tile); every row runs the same operations
   whatever rows share the step. */
static inline __attribute__((always_inline)) void rows_tile(const int M, const float *x, const int8_t *qg,
        const float *dg, float *y, int64_t N, int64_t K, int64_t n0) {
    const int64_t nb = K / 32;
    __m512 acc[8];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 b0[8], b1[8];
        for (int m = 0; m < M; m++) b0[m] = b1[m] = _mm512_setzero_ps();
        for (int64_t k = b * 32; k < b * 32 + 32; k += 2) {
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qg + k * 16))));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qg + k * 16 + 16))));
            for (int m = 0; m < M; m++) {
                b0[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[m * K + k]), b0[m]);
                b1[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[m * K + k + 1]), b1[m]);
            }
        }
        const __m512 scale = _mm512_loadu_ps(dg + b * 16);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(b0[m], b1[m]), acc[m]);
    }
    for (int m = 0; m < M; m++) {
        float out[16];
        _mm512_storeu_ps(out, acc[m]);
        for (int l = 0; l < 16 && n0 + l < N; l++) y[m * N + n0 + l] = out[l];
    }
}
#define ROWS 8
#else
/* AVX2 + FMA: the same layout, each 16-row group as two vectors of 8 rows (the same sums in the
   same order per lane: two chains, even and odd channels); up to 2 rows a tile, so a step of more
   reads a group's weights (a few KB) again from the L1 cache. */
static inline __attribute__((always_inline)) void rows_tile(const int M, const float *x, const int8_t *qg,
        const float *dg, float *y, int64_t N, int64_t K, int64_t n0) {
    const int64_t nb = K / 32;
    __m256 acc[2][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 b0[2][2], b1[2][2];
        for (int m = 0; m < M; m++) b0[m][0] = b0[m][1] = b1[m][0] = b1[m][1] = _mm256_setzero_ps();
        for (int64_t k = b * 32; k < b * 32 + 32; k += 2) {
            const int8_t *q = qg + k * 16;
            const __m256 w00 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
            const __m256 w01 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
            const __m256 w10 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16))));
            const __m256 w11 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 24))));
            for (int m = 0; m < M; m++) {
                const __m256 x0 = _mm256_broadcast_ss(x + m * K + k), x1 = _mm256_broadcast_ss(x + m * K + k + 1);
                b0[m][0] = _mm256_fmadd_ps(w00, x0, b0[m][0]);
                b0[m][1] = _mm256_fmadd_ps(w01, x0, b0[m][1]);
                b1[m][0] = _mm256_fmadd_ps(w10, x1, b1[m][0]);
                b1[m][1] = _mm256_fmadd_ps(w11, x1, b1[m][1]);
            }
        }
        const __m256 s0 = _mm256_loadu_ps(dg + b * 16), s1 = _mm256_loadu_ps(dg + b * 16 + 8);
        for (int m = 0; m < M; m++) {
            acc[m][0] = _mm256_fmadd_ps(s0, _mm256_add_ps(b0[m][0], b1[m][0]), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(s1, _mm256_add_ps(b0[m][1], b1[m][1]), acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++) {
        float out[16];
        _mm256_storeu_ps(out, acc[m][0]);
        _mm256_storeu_ps(out + 8, acc[m][1]);
        for (int l = 0; l < 16 && n0 + l < N; l++) y[m * N + n0 + l] = out[l];
    }
}
#define ROWS 2
#endif

void q8_linear(const float *x, int64_t M, const int8_t *q, const float *d, float *y, int64_t N, int64_t K) {
    const int64_t nb = K / 32, groups = (N + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *qg = q + g * K * 16;
        const float *dg = d + g * nb * 16;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N;
            switch (M - m0 < ROWS ? M - m0 : ROWS) {    /* a constant row count each: the tile stays in registers */
                case 1: rows_tile(1, xm, qg, dg, ym, N, K, g * 16); break;
                case 2: rows_tile(2, xm, qg, dg, ym, N, K, g * 16); break;
#if ROWS > 2
                case 3: rows_tile(3, xm, qg, dg, ym, N, K, g * 16); break;
                case 4: rows_tile(4, xm, qg, dg, ym, N, K, g * 16); break;
                case 5: rows_tile(5, xm, qg, dg, ym, N, K, g * 16); break;
                case 6: rows_tile(6, xm, qg, dg, ym, N, K, g * 16); break;
                case 7: rows_tile(7, xm, qg, dg, ym, N, K, g * 16); break;
                default: rows_tile(8, xm, qg, dg, ym, N, K, g * 16); break;
#endif
            }
        }
    }
}
"""

_lib: Optional[ctypes.CDLL] = None
_loaded = False


def load() -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use; None where it cannot be built or the CPU has
    neither AVX-512 nor AVX2 with FMA (the kernel is written in their intrinsics)."""
    global _lib, _loaded
    if not _loaded:
        flags = cpu_flags()
        usable = "avx512f" in flags or {"avx2", "fma"} <= flags
        lib = load_library("q8_head", SOURCE, [*OPTIMIZE, "-ffast-math"]) if usable else None
        if lib is not None:
            lib.q8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
            lib.q8_linear.restype = None
        _lib, _loaded = lib, True
    return _lib


def _groups_of_16(t: torch.Tensor) -> torch.Tensor:
    """`[N, C]` -> `[Np/16, C, 16]`: each 16 rows interleaved (a vector's lanes are 16 output rows),
    rows beyond N zeros."""
    padded = torch.zeros(-(-t.shape[0] // 16) * 16, t.shape[1], dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded.view(-1, 16, t.shape[1]).transpose(1, 2).contiguous()


def stored_as_q8_0(gguf, name: str) -> bool:  # noqa: ANN001
    """Whether the checkpoint (`gguf`: its GGUF block reader, None for other formats' tensors) holds
    the matrix `name` as Q8_0 rows of whole blocks, the form this head reads."""
    blocks = gguf(name)
    return blocks is not None and blocks.qtype == Q8_0 and blocks.in_features % BLOCK == 0


class Q8Head:
    """A Q8_0 matrix `[N, K]` from a GGUF's blocks: ``linear(x)`` = ``x @ W.T`` against float
    activations (this module's kernel), ``linear_int8(x)`` the same against int8 activations
    (quant/cpu_w8a8.py). The form of the weight the head is built for (`int8_activations`) is made
    at once, the other on its first call."""

    def __init__(self, blocks: GGUFBlocks, int8_activations: bool = False):
        if blocks.qtype != Q8_0 or blocks.in_features % BLOCK:
            raise ValueError(f"not Q8_0 rows of whole blocks: type {blocks.qtype}, {blocks.in_features} columns")
        self._blocks = blocks             # memory-mapped from the checkpoint: each form is built from it
        self.out_features, self.in_features = blocks.out_features, blocks.in_features
        self._float_form: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._int8_form: Optional[cpu_w8a8.W8A8Weight] = None
        if int8_activations:
            self._int8_weight()
        else:
            self._float_weight()

    @classmethod
    def from_checkpoint(cls, gguf, name: str, int8_activations: bool = False) -> Optional["Q8Head"]:
        """The Q8_0 form of the checkpoint's matrix `name`, where it is stored so and the kernel it
        will run (``linear_int8``'s where `int8_activations`, else ``linear``'s) builds."""
        if not stored_as_q8_0(gguf, name):
            return None
        if not (cpu_w8a8.available() if int8_activations else load() is not None):
            return None
        return cls(gguf(name), int8_activations)

    def _values_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values `[N, K]`, float32 scales `[N, K/32]`) read from the blocks."""
        n, k = self.out_features, self.in_features
        raw = np.ascontiguousarray(self._blocks.raw).reshape(n, k // BLOCK, BLOCK_BYTES)
        scales = torch.from_numpy(raw[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK))
        values = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).reshape(n, k))
        return values, scales

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix `[N, K]` (``q * d``: the GGUF's own values)."""
        values, scales = self._values_and_scales()
        return (values.float().view(self.out_features, -1, BLOCK) * scales[..., None]).view(self.out_features,
                                                                                          self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `x` `[M, K]` (any float dtype; computed in float32) -> float32 `[M, N]`."""
        assert x.dim() == 2 and x.shape[1] == self.in_features, f"rows of {self.in_features}, got {tuple(x.shape)}"
        values, scales = self._float_weight()
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        load().q8_linear(x.data_ptr(), x.shape[0], values.data_ptr(), scales.data_ptr(), y.data_ptr(),
                         self.out_features, self.in_features)
        return y

    def linear_int8(self, x: torch.Tensor) -> torch.Tensor:
        """Rows `x` `[M, K]` (float32 or bfloat16) quantized to int8 per row and block of 32 (Q8_0's
        rule, as the W4A8 layers' activations) -> float32 `[M, N]` (quant/cpu_w8a8.py)."""
        assert x.dim() == 2 and x.shape[1] == self.in_features, f"rows of {self.in_features}, got {tuple(x.shape)}"
        return self._int8_weight().linear(x if x.dtype in (torch.float32, torch.bfloat16) else x.float())

    def _float_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float kernel's form: values `[Np/16, K, 16]` and scales `[Np/16, K/32, 16]`."""
        if self._float_form is None:
            values, scales = self._values_and_scales()
            self._float_form = (_groups_of_16(values), _groups_of_16(scales))
        return self._float_form

    def _int8_weight(self) -> cpu_w8a8.W8A8Weight:
        """The W8A8 kernel's form."""
        if self._int8_form is None:
            self._int8_form = cpu_w8a8.W8A8Weight(*self._values_and_scales())
        return self._int8_form

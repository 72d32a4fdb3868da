"""INT4 weights x bfloat16 activations for an INT4 model's small steps on the CPU: a C kernel of ours.

A step of one to a few rows (a batch-1 decode) is bound by reading the 4-bit weights, and the
arithmetic that turns them into products must keep up with memory. torch's int4 CPU kernel
(tinygemm) read the default model's 30 layers at ~16 GB/s on a 2-core Zen 4 EPYC, half what the
machine streams. This kernel does per 4 weights of 16 outputs almost nothing but the multiply:

    y[m, n] = sum_g  scale[n, g] * sum_{k in g} q[n, k] * x[m, k]  +  min[n, g] * sum_{k in g} x[m, k]

with the 4-bit values 0..15 made bfloat16 by a table lookup (``vpermw``: exact, small integers)
and multiplied by the bfloat16 activations in pairs with AVX-512 BF16's ``vdpbf16ps`` (float32
sums, the products exact), one float multiply-add per group by its scale and one by its min
against the group's activation sum (float32). The activations are the bfloat16 that torch's int4
kernel took as well; the weights are exactly the INT4 values (``q * scale + min``).

Packed layout (``W4Bf16Weight.packed``): for each 16 outputs and each 4 input channels k..k+3, 32
bytes; byte ``j`` holds output ``j // 2``'s channel ``k + j % 2`` in its low nibble and ``k + 2 +
j % 2`` in its high nibble, so one widening load and a mask (or a shift) give the 32 bfloat16
lanes ``vdpbf16ps`` pairs with (x[k], x[k + 1]) (or (x[k + 2], x[k + 3])). Scales and mins float16
``[N/16, K/G, 2, 16]`` (one 64-byte line per group of 16 outputs). A group's 16 outputs x (up to)
8 rows are one register tile; more rows run eight at a time. Every row's result depends on that
row alone.

On that Zen 4, ``python -m bench.quant_kernels --threads 2`` ("w4 bf16"), ms per step over the
30 layers' projections at M = 1 / 2 / 4 / 8: 2.7 / 3.3 / 3.8 / 6.7 against tinygemm's 4.2 / 4.9 /
6.5 / 12.9; one call over 66 MB of weights streams them at 34 GB/s (ad hoc), so a step of many
small calls is bound by their overhead, not the arithmetic.

The AVX2 form (CPUs with AVX2, FMA and F16C but not AVX-512 BF16: Zen 2/3, Haswell to Ice Lake)
reads the same packed layout with integer dot products: each row's activations are made int16 per
group with a power-of-two scale (the group's largest magnitude to 2^14..2^15, so every bfloat16
value within 2^7 of it is an exact integer and a smaller one is off by at most 2^-16 of that
largest: far below the bfloat16 rounding the activations already had), the 4-bit values meet them in
``vpmaddwd`` (exact int32 sums, exactly float32 at the group's end), and per group one float
multiply-add by scale x 2^e and one by the min. Widening the 4-bit values to float instead (an AND
and a convert per weight) made the kernel compute-bound on a Zen 3 core; this form reads the weights
at memory speed. On a 2-core AMD EPYC Zen 3 (AVX2 only; 2026-11-27), ``python -m bench.quant_kernels
--threads 2 --rows 1,2,4,8,16``, ms per step over the 30 layers' projections: 8.2 / 9.4 / 15.0 /
22.7 / 44.1 against tinygemm's 12.3 / 17.6 / 21.5 / 35.5 / 78.5 (the machine loaded by a neighbour
then; at a quieter time, ad hoc, 4.9 ms at M = 1: 60 MB at ~12 GB/s, where one call of the same bytes
streams at ~20 GB/s, what the machine reads with two threads).

Needs AVX-512 BF16 and BW, or AVX2 with FMA and F16C (``available``); elsewhere the INT4 layer
keeps torch's kernel (quant/int4_linear.py).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from nightshift.engine.cpu_features import cpu_flags
from nightshift.engine.kernels.c_library import OPTIMIZE, load_library
from nightshift.engine.quant.format import Int4Weight, unpack_int4

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* M rows (1..8) x one group of 16 outputs: pk the group's packed weights (K/4 chunks of 32 bytes),
   sm its scales and mins (K/G lines of 16 + 16 float16), x the rows' bfloat16 pairs as 32-bit
   words, xs their group sums [M, K/G]; writes y[m, n0 .. n0 + count) as bfloat16 */
static inline __attribute__((always_inline)) void tile(const int M, const uint8_t *pk, const uint16_t *sm,
        const uint32_t *x, const float *xs, int64_t K, int64_t G, uint16_t *y, int64_t N, int64_t n0,
        int64_t count, __m512i lut) {
    const int64_t ng = K / G, half = K / 2;
    __m512 out[8];
    for (int m = 0; m < M; m++) out[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 even[8], odd[8];          /* two chains a row (channels k, k+1 | k+2, k+3): half the latency */
        for (int m = 0; m < M; m++) even[m] = odd[m] = _mm512_setzero_ps();
        for (int64_t c = 0; c < G / 4; c++) {
            const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)pk));
            pk += 32;
            const __m512bh a = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(t, _mm512_set1_epi16(15)), lut);
            const __m512bh b = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(t, 4), lut);
            const int64_t p = (g * G + c * 4) / 2;             /* the pair (x[k], x[k + 1]) */
            for (int m = 0; m < M; m++) {
                even[m] = _mm512_dpbf16_ps(even[m], a, (__m512bh)_mm512_set1_epi32((int)x[m * half + p]));
                odd[m] = _mm512_dpbf16_ps(odd[m], b, (__m512bh)_mm512_set1_epi32((int)x[m * half + p + 1]));
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sm));
        const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + 16)));
        sm += 32;
        for (int m = 0; m < M; m++) {
            out[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(even[m], odd[m]), out[m]);
            out[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(xs[m * ng + g]), out[m]);
        }
    }
    const __mmask16 keep = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
    for (int m = 0; m < M; m++)
        _mm256_mask_storeu_epi16(y + m * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(out[m]));
}

#define ROWS 8                      /* rows a register tile holds */
#define TILE_ARGS(r) r, pk, sm, xw + m0 * (K / 2), xs + m0 * ng, K, G, y + m0 * N, N, t * 16, count, lut
#else
/* AVX2 (+ FMA, F16C): integer dot products. Each row's activations are made int16 per group of G
   channels with a power-of-two scale 2^e (the group's largest magnitude becomes 2^14..2^15: a
   bfloat16 value within 2^7 of it is an integer there, so exact; a smaller one is off by at most
   2^-16 of that largest), and the 4-bit values meet them in ``vpmaddwd`` (16-bit products summed in
   pairs into int32: exact, and a group's sum fits 24 bits, so float32 holds it exactly). The same
   packed layout, each 16 bytes of a chunk (8 outputs) widened to 16-bit words: a word's low nibble
   and the next word's are output o's channels (k, k + 1), the high nibbles (k + 2, k + 3), in the
   pairs ``vpmaddwd`` multiplies with (x[k], x[k + 1]) and (x[k + 2], x[k + 3]). Per group and output
   one float multiply-add by scale * 2^e and one by min * the group's float32 activation sum.
   x16: the rows' int16 pairs as 32-bit words [M, K/2]; xe: 2^e per row and group [M, K/G]. */
#define ROWS 2                      /* rows a register tile holds */
static inline __attribute__((always_inline)) void tile(const int M, const uint8_t *pk, const uint16_t *sm,
        const uint32_t *x16, const float *xe, const float *xs, int64_t K, int64_t G, uint16_t *y, int64_t N,
        int64_t n0, int64_t count) {
    const int64_t ng = K / G, half = K / 2;
    __m256 out[ROWS][2];
    for (int m = 0; m < M; m++) out[m][0] = out[m][1] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi16(15);
    for (int64_t g = 0; g < ng; g++) {
        __m256i acc[ROWS][2];
        for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
        for (int64_t c = 0; c < G / 4; c++) {
            const int64_t p = (g * G + c * 4) / 2;            /* the pair (x[k], x[k + 1]) */
            for (int h = 0; h < 2; h++) {
                const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(pk + 16 * h)));
                const __m256i a = _mm256_and_si256(t, nibble), b = _mm256_srli_epi16(t, 4);
                for (int m = 0; m < M; m++) {
                    acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(a, _mm256_set1_epi32((int)x16[m * half + p])));
                    acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(b, _mm256_set1_epi32((int)x16[m * half + p + 1])));
                }
            }
            pk += 32;
        }
        for (int h = 0; h < 2; h++) {
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + 8 * h)));
            const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sm + 16 + 8 * h)));
            for (int m = 0; m < M; m++) {
                const __m256 sum = _mm256_cvtepi32_ps(acc[m][h]);
                out[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(xe[m * ng + g])), sum, out[m][h]);
                out[m][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(xs[m * ng + g]), out[m][h]);
            }
        }
        sm += 32;
    }
    for (int m = 0; m < M; m++) {
        float f[16];
        _mm256_storeu_ps(f, out[m][0]);
        _mm256_storeu_ps(f + 8, out[m][1]);
        for (int64_t l = 0; l < count; l++) {     /* round to nearest even, NaN quiet: as torch's cast */
            uint32_t u; memcpy(&u, f + l, 4);
            y[m * N + n0 + l] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0
                                                              : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

#define TILE_ARGS(r) r, pk, sm, x16w + m0 * (K / 2), xe + m0 * ng, xs + m0 * ng, K, G, y + m0 * N, N, t * 16, count
#endif

/* y [M, N] bfloat16 = x [M, K] bfloat16 @ W.T, W packed as the module docstring says */
void w4_bf16_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t G, const uint8_t *packed,
                  const uint16_t *scales_mins, uint16_t *y, int64_t N) {
    const int64_t ng = K / G, tiles = (N + 15) / 16;
    float *xs = (float *)malloc(sizeof(float) * (M * ng + 1));
    for (int64_t m = 0; m < M; m++)          /* each row's group sums of x, float32 in channel order */
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                uint32_t u = (uint32_t)x[m * K + k] << 16; float f; memcpy(&f, &u, 4); s += f;
            }
            xs[m * ng + g] = s;
        }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    uint16_t table[32];
    for (int i = 0; i < 32; i++) { float f = (float)(i & 15); uint32_t u; memcpy(&u, &f, 4); table[i] = (uint16_t)(u >> 16); }
    const __m512i lut = _mm512_loadu_si512(table);
    const uint32_t *xw = (const uint32_t *)x;
#else
    int16_t *x16 = (int16_t *)malloc(sizeof(int16_t) * (M * K + 16));
    float *xe = (float *)malloc(sizeof(float) * (M * ng + 1));
    for (int64_t m = 0; m < M; m++)          /* int16 activations, a power-of-two scale per row and group */
        for (int64_t g = 0; g < ng; g++) {
            const uint16_t *xg = x + m * K + g * G;
            uint16_t top = 0;                    /* the largest magnitude's bits (NaN above every number) */
            for (int64_t k = 0; k < G; k++) top = (xg[k] & 0x7fffu) > top ? (xg[k] & 0x7fffu) : top;
            int16_t *out = x16 + m * K + g * G;
            if (top >= 0x7f80u) {                /* Inf or NaN: the group's results NaN */
                xe[m * ng + g] = __builtin_nanf("");
                memset(out, 0, sizeof(int16_t) * G);
                continue;
            }
            const int e = top >> 7 ? (int)(top >> 7) - 126 : -125;     /* top < 2^e (frexp's e) */
            xe[m * ng + g] = ldexpf(1.f, e - 15);
            const int up = 15 - e;               /* x * 2^up in two exact steps (2^up may not fit a float) */
            const __m256 f1 = _mm256_set1_ps(ldexpf(1.f, up / 2)), f2 = _mm256_set1_ps(ldexpf(1.f, up - up / 2));
            for (int64_t k = 0; k < G; k += 8) {
                const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xg + k)));
                const __m256 f = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), f1), f2);
                const __m256i i = _mm256_cvtps_epi32(f);                  /* round to nearest even */
                _mm_storeu_si128((__m128i *)(out + k), _mm_packs_epi32(_mm256_castsi256_si128(i),
                                                                       _mm256_extracti128_si256(i, 1)));
            }
        }
    const uint32_t *x16w = (const uint32_t *)x16;
#endif
    #pragma omp parallel for schedule(static) if (tiles > 4)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *pk = packed + t * (K / 4) * 32;
        const uint16_t *sm = scales_mins + t * ng * 32;
        const int64_t count = N - t * 16 < 16 ? N - t * 16 : 16;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            switch (M - m0 < ROWS ? M - m0 : ROWS) {  /* a constant row count each: the tile stays in registers */
                case 1: tile(TILE_ARGS(1)); break;
#if ROWS > 2
                case 2: tile(TILE_ARGS(2)); break;
                case 3: tile(TILE_ARGS(3)); break;
                case 4: tile(TILE_ARGS(4)); break;
                case 5: tile(TILE_ARGS(5)); break;
                case 6: tile(TILE_ARGS(6)); break;
                case 7: tile(TILE_ARGS(7)); break;
#endif
                default: tile(TILE_ARGS(ROWS)); break;
            }
        }
    }
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
    free(x16);
    free(xe);
#endif
    free(xs);
}
"""

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_loaded = False


def available() -> bool:
    """Whether the CPU has AVX-512 BF16 and BW, or AVX2 with FMA and F16C, and the kernel builds here."""
    return load() is not None


def load() -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use (its AVX-512 BF16 form where the CPU has it, else its
    AVX2 form); None where the CPU has neither or it cannot be built."""
    global _lib, _loaded
    if _loaded:                 # every small step asks: no lock once built
        return _lib
    with _lock:
        if not _loaded:
            flags = cpu_flags()
            lib = None
            if {"avx512f", "avx512bw", "avx512_bf16"} <= flags or {"avx2", "fma", "f16c"} <= flags:
                lib = load_library("w4_bf16", SOURCE, OPTIMIZE)
            if lib is not None:
                lib.w4_bf16_gemm.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + \
                    [ctypes.c_int64]
                lib.w4_bf16_gemm.restype = None
            _lib, _loaded = lib, True
    return _lib


class W4Bf16Weight:
    """An INT4 weight repacked for the kernel (still 4 bits a weight) with float16 scales and mins;
    ``linear`` is ``x @ W.T`` for bfloat16 rows."""

    def __init__(self, weight: Int4Weight):
        n, k, g = weight.out_features, weight.in_features, weight.group_size
        self.out_features, self.in_features, self.group_size = n, k, g
        padded = -(-n // 16) * 16
        q = torch.zeros(padded, k, dtype=torch.uint8)
        q[:n] = unpack_int4(weight.qweight)
        # [N/16, 16 outputs o, K/4 chunks, 2 halves h (k, k+1 | k+2, k+3), 2 channels p] -> [N/16, K/4, h, o, p]
        q = q.reshape(padded // 16, 16, k // 4, 2, 2).permute(0, 2, 3, 1, 4)
        self.packed = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()            # [N/16, K/4, 16, 2] bytes
        both = torch.zeros(padded, k // g, 2, dtype=torch.float16)
        both[:n, :, 0], both[:n, :, 1] = weight.scales, weight.mins
        self.scales_mins = both.reshape(padded // 16, 16, k // g, 2).permute(0, 2, 3, 1).contiguous()

    def linear(self, x2d: torch.Tensor) -> torch.Tensor:
        """bfloat16 `[M, K]` -> bfloat16 `[M, N]`."""
        assert x2d.dtype == torch.bfloat16 and x2d.dim() == 2 and x2d.shape[1] == self.in_features
        x2d = x2d.contiguous()
        y = torch.empty(x2d.shape[0], self.out_features, dtype=torch.bfloat16)
        if x2d.shape[0]:
            load().w4_bf16_gemm(x2d.data_ptr(), x2d.shape[0], self.in_features, self.group_size,
                                self.packed.data_ptr(), self.scales_mins.data_ptr(), y.data_ptr(),
                                self.out_features)
        return y

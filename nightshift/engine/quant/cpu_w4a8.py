"""INT4 weights x int8 activations on the CPU (W4A8, as llama.cpp's Q4 x Q8_0): a C kernel of ours.

The weight stays 4-bit in memory, repacked once at load (``W4A8Weight``); each call quantizes its
activations to int8 in blocks of 32 input channels (one float32 scale per row and block, the
block's absolute maximum mapped to 127, as GGUF's Q8_0) and multiplies 4-bit x int8 in integers:

    y[i, n] = sum_b  sw[n, g(b)] * dx[i, b] * sum_{k in b} q[n, k] * xq[i, k]      (integer dot)
            + sum_g  min[n, g] * sum_{k in g} x[i, k]                               (exact float sums)

The integer dot is AVX-512 VNNI's ``vpdpbusd`` where the CPU has it (64 unsigned 4-bit weights x
signed int8 activations, each int32 lane summing four products, in one instruction; a register
tile of 4 rows x 32 outputs), else AVX2's ``vpmaddubsw`` (pairs summed into int16: 16 products of
one block fit an int16 lane exactly, at most 16 * 15 * 127) and ``vpmaddwd`` by ones into int32
once per block (a tile of 4 rows x 16 outputs); then one float multiply-add per block with the
product of the two scales. Both forms compute the same integers and the same float operations in
the same order, so they give the same bits (``load(avx2=True)`` builds the AVX2 form anywhere, for
the tests and ``bench.quant_kernels``). The rows are padded to a multiple of 4 and the outputs to
32 (zero weights) inside the kernel's buffers.

Packed layout (``W4A8Weight.packed``): for each 16 outputs and each block of 32 input channels,
256 bytes as four 64-byte vectors; vector ``L`` holds, for output ``o`` and byte ``j`` (0..3), the
weight of input channel ``4L + j`` in the low nibble and ``16 + 4L + j`` in the high nibble, so a
mask and a shift give two vectors of [16 outputs x 4 channels] bytes, the multiply's operand
against four activation bytes broadcast to every lane (AVX2 reads each vector as two halves of 8
outputs). Scales and mins are float32 ``[N/16, K/G, 16]``.

Needs AVX2 and FMA (``available``); every INT4 weight fits (its groups, 32, 64 or 128 channels,
are whole blocks, and K a whole number of groups).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from nightshift.engine.cpu_features import cpu_flags
from nightshift.engine.kernels.c_library import OPTIMIZE, load_library
from nightshift.engine.quant.format import Int4Weight, unpack_int4

BLOCK = 32          # activation quantization block (input channels), as Q8_0
TILE_ROWS = 4       # rows of one register tile
TILE_OUT = 32       # outputs padded to a whole AVX-512 VNNI tile (two vectors of 16; AVX2's is 16)

# what every int8-activation kernel shares (engine/quant/cpu_w8a8.py compiles it too): bfloat16
# conversions, the rows' store, and the activations' quantization
ROWS_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {        /* round to nearest even, as torch */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 8 floats -> 8 bfloat16, f32_to_bf16's rounding (nearest even; NaN -> quiet NaN) in AVX2 */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* one tile row's `count` outputs (from output n0 on) + bias (0.f where none, as always: -0.f
   becomes 0.f) into row `offset` of y, float32 or bfloat16: eight at a time, the rest one by one
   (the same operations either way; a scalar loop here cost a third of a bfloat16 call) */
static inline void store_outputs(const float *out, int64_t count, const float *bias, int64_t n0,
                                 void *y, int64_t offset, int y_bf16) {
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(out + j), bias ? _mm256_loadu_ps(bias + n0 + j) : _mm256_setzero_ps());
        if (y_bf16) _mm_storeu_si128((__m128i *)((uint16_t *)y + offset + j), bf16x8(v));
        else _mm256_storeu_ps((float *)y + offset + j, v);
    }
    for (; j < count; j++) {
        const float v = out[j] + (bias ? bias[n0 + j] : 0.f);
        if (y_bf16) ((uint16_t *)y)[offset + j] = f32_to_bf16(v);
        else ((float *)y)[offset + j] = v;
    }
}

/* x [M, K] (float32, or bfloat16 when x_bf16) -> xq [Mp, K] int8 (rows M..Mp-1 zero), dx [Mp, K/32]
   (the blocks' scales, 0 for padding), xs [Mp, K/G] (the groups' exact float sums). */
void quantize_rows(const void *x, int64_t M, int64_t Mp, int64_t K, int64_t G, int x_bf16,
                   int8_t *xq, float *dx, float *xs) {
    const int64_t nb = K / 32, ng = K / G;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Mp; i++) {
        if (i >= M) {
            memset(xq + i * K, 0, K); memset(dx + i * nb, 0, nb * 4); memset(xs + i * ng, 0, ng * 4);
            continue;
        }
        const __m256 sign = _mm256_set1_ps(-0.f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t g = 0; g < ng; g++) xs[i * ng + g] = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = i * K + b * 32;
            __m256 v[4];
            for (int j = 0; j < 4; j++) {
                if (x_bf16) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k0 + 8 * j));
                    v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                } else {
                    v[j] = _mm256_loadu_ps((const float *)x + k0 + 8 * j);
                }
            }
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m256 t = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4)); m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4)); t4 = _mm_add_ss(t4, _mm_movehdup_ps(t4));
            const float amax = _mm_cvtss_f32(m4);
            xs[i * ng + (b * 32) / G] += _mm_cvtss_f32(t4);
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            dx[i * nb + b] = amax / 127.f;
            const __m256 scale = _mm256_set1_ps(inv);
            __m256i q[4];          /* round to nearest even (the default rounding mode), as lrintf */
            for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + k0), _mm256_permutevar8x32_epi32(p, order));
        }
    }
}

"""

# the W4A8 product (its two forms)
GEMM_SOURCE = r"""
/* y [M, N] (float32, or bfloat16 when y_bf16) = the W4A8 product (+ bias float32 [N] or NULL).
   w: packed [Np/16, K/32, 4, 16, 4] bytes; sw, mw: float32 [Np/16, K/G, 16]; xq/dx/xs from
   quantize_rows with Mp a multiple of 4; Np a multiple of 32. Both forms below compute the same
   integer dots and the same float operations in the same order: the same bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(W4A8_AVX2)
/* AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned weight bytes by the broadcast four activation
   bytes and adds each lane's four products into int32 in one instruction. Register tile: 4 rows x
   32 outputs (two vectors of 16), its float sums in registers too (32 of them here). */
void w4a8_gemm(const int8_t *xq, const float *dx, const float *xs, int64_t M, int64_t Mp, int64_t K, int64_t G,
               const uint8_t *w, const float *sw, const float *mw, const float *bias,
               void *y, int64_t N, int64_t Np, int y_bf16) {
    const int64_t nb = K / 32, ng = K / G, bpg = G / 32, quads = Np / 32, tiles = Mp / 4;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < quads; p++) {
        for (int64_t t = 0; t < tiles; t++) {
            const __m512i low = _mm512_set1_epi8(0x0F);
            const int64_t v0 = 2 * p, m0 = 4 * t;       /* 16-output groups v0 and v0 + 1 */
            const uint8_t *w0 = w + v0 * nb * 256, *w1 = w0 + nb * 256;
            __m512 f[4][2];
            for (int r = 0; r < 4; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                const __m512 s0 = _mm512_loadu_ps(sw + (v0 * ng + g) * 16), s1 = _mm512_loadu_ps(sw + ((v0 + 1) * ng + g) * 16);
                for (int64_t bb = 0; bb < bpg; bb++) {
                    const int64_t b = g * bpg + bb;
                    __m512i d[4][2];
                    for (int r = 0; r < 4; r++) d[r][0] = d[r][1] = _mm512_setzero_si512();
                    const int8_t *xb = xq + m0 * K + b * 32;
                    const uint8_t *wb0 = w0 + b * 256, *wb1 = w1 + b * 256;
                    for (int L = 0; L < 4; L++) {
                        const __m512i raw0 = _mm512_loadu_si512((const void *)(wb0 + L * 64));
                        const __m512i raw1 = _mm512_loadu_si512((const void *)(wb1 + L * 64));
                        const __m512i lo0 = _mm512_and_si512(raw0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(raw0, 4), low);
                        const __m512i lo1 = _mm512_and_si512(raw1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(raw1, 4), low);
                        for (int r = 0; r < 4; r++) {
                            int32_t xl, xh;
                            memcpy(&xl, xb + r * K + 4 * L, 4); memcpy(&xh, xb + r * K + 16 + 4 * L, 4);
                            const __m512i vl = _mm512_set1_epi32(xl), vh = _mm512_set1_epi32(xh);
                            d[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[r][0], lo0, vl), hi0, vh);
                            d[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[r][1], lo1, vl), hi1, vh);
                        }
                    }
                    for (int r = 0; r < 4; r++) {
                        const __m512 dd = _mm512_set1_ps(dx[(m0 + r) * nb + b]);
                        f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), _mm512_mul_ps(s0, dd), f[r][0]);
                        f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]), _mm512_mul_ps(s1, dd), f[r][1]);
                    }
                }
                const __m512 n0 = _mm512_loadu_ps(mw + (v0 * ng + g) * 16), n1 = _mm512_loadu_ps(mw + ((v0 + 1) * ng + g) * 16);
                for (int r = 0; r < 4; r++) {
                    const __m512 sx = _mm512_set1_ps(xs[(m0 + r) * ng + g]);
                    f[r][0] = _mm512_fmadd_ps(n0, sx, f[r][0]);
                    f[r][1] = _mm512_fmadd_ps(n1, sx, f[r][1]);
                }
            }
            const int64_t n0 = v0 * 16, count = N - n0 < 32 ? N - n0 : 32;
            for (int r = 0; r < 4 && m0 + r < M; r++) {
                float out[32];
                _mm512_storeu_ps(out, f[r][0]); _mm512_storeu_ps(out + 16, f[r][1]);
                store_outputs(out, count, bias, n0, y, (m0 + r) * N + n0, y_bf16);
            }
        }
    }
}
#else
/* AVX2: `vpmaddubsw` (pairs of products into int16: 16 products of one block fit an int16 lane
   exactly, at most 16 * 15 * 127), `vpmaddwd` by ones into int32 once a block. Register tile: 4
   rows x 16 outputs (two vectors of 8). */
void w4a8_gemm(const int8_t *xq, const float *dx, const float *xs, int64_t M, int64_t Mp, int64_t K, int64_t G,
               const uint8_t *w, const float *sw, const float *mw, const float *bias,
               void *y, int64_t N, int64_t Np, int y_bf16) {
    const int64_t nb = K / 32, ng = K / G, bpg = G / 32, pairs = Np / 16, tiles = Mp / 4;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t t = 0; t < tiles; t++) {
            const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
            const int64_t m0 = 4 * t;                  /* the 16-output group p: two vectors of 8 */
            const uint8_t *w0 = w + p * nb * 256, *w1 = w0 + 32;
            /* the float tile lives in memory (L1), touched once a block: the registers are the
               integer accumulators' (an empty asm taking its address keeps it there) */
            float tile[4][16] __attribute__((aligned(32)));
            memset(tile, 0, sizeof tile);
            __asm__ volatile("" : : "r"(tile) : "memory");
            for (int64_t g = 0; g < ng; g++) {
                const __m256 s0 = _mm256_loadu_ps(sw + (p * ng + g) * 16), s1 = _mm256_loadu_ps(sw + (p * ng + g) * 16 + 8);
                for (int64_t bb = 0; bb < bpg; bb++) {
                    const int64_t b = g * bpg + bb;
                    __m256i d00 = _mm256_setzero_si256(), d01 = d00, d10 = d00, d11 = d00,
                            d20 = d00, d21 = d00, d30 = d00, d31 = d00;
                    const int8_t *x0 = xq + m0 * K + b * 32, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
                    const uint8_t *wb0 = w0 + b * 256, *wb1 = w1 + b * 256;
                    #pragma GCC unroll 1
                    for (int L = 0; L < 4; L++) {
                        const __m256i raw0 = _mm256_loadu_si256((const __m256i *)(wb0 + L * 64));
                        const __m256i raw1 = _mm256_loadu_si256((const __m256i *)(wb1 + L * 64));
                        /* the low nibbles (channels 4L..4L+3) against every row, then the high ones
                           (16+4L..): two weight vectors live at a time, eight accumulators. The empty
                           asm after each row pins its two accumulators in registers there: without it
                           (and without -fno-tree-reassoc) GCC computed every product first and spilled
                           accumulators: 230 instead of ~318 GOP/s on a 2-core AVX2 EPYC, timed ad hoc. */
#define W4A8_ROWS(w0v, w1v, off) do { \
                            const __m256i wa = (w0v), wc = (w1v); __m256i xv; int32_t xw; \
                            memcpy(&xw, x0 + (off), 4); xv = _mm256_set1_epi32(xw); \
                            d00 = _mm256_add_epi16(d00, _mm256_maddubs_epi16(wa, xv)); \
                            d01 = _mm256_add_epi16(d01, _mm256_maddubs_epi16(wc, xv)); __asm__("" : "+x"(d00), "+x"(d01)); \
                            memcpy(&xw, x1 + (off), 4); xv = _mm256_set1_epi32(xw); \
                            d10 = _mm256_add_epi16(d10, _mm256_maddubs_epi16(wa, xv)); \
                            d11 = _mm256_add_epi16(d11, _mm256_maddubs_epi16(wc, xv)); __asm__("" : "+x"(d10), "+x"(d11)); \
                            memcpy(&xw, x2 + (off), 4); xv = _mm256_set1_epi32(xw); \
                            d20 = _mm256_add_epi16(d20, _mm256_maddubs_epi16(wa, xv)); \
                            d21 = _mm256_add_epi16(d21, _mm256_maddubs_epi16(wc, xv)); __asm__("" : "+x"(d20), "+x"(d21)); \
                            memcpy(&xw, x3 + (off), 4); xv = _mm256_set1_epi32(xw); \
                            d30 = _mm256_add_epi16(d30, _mm256_maddubs_epi16(wa, xv)); \
                            d31 = _mm256_add_epi16(d31, _mm256_maddubs_epi16(wc, xv)); __asm__("" : "+x"(d30), "+x"(d31)); } while (0)
                        W4A8_ROWS(_mm256_and_si256(raw0, low), _mm256_and_si256(raw1, low), 4 * L);
                        W4A8_ROWS(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), low),
                                  _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low), 16 + 4 * L);
#undef W4A8_ROWS
                    }
                    const __m256i dots[4][2] = {{d00, d01}, {d10, d11}, {d20, d21}, {d30, d31}};
                    for (int r = 0; r < 4; r++) {
                        const __m256 d = _mm256_set1_ps(dx[(m0 + r) * nb + b]);
                        _mm256_store_ps(tile[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r][0], ones)),
                                                                 _mm256_mul_ps(s0, d), _mm256_load_ps(tile[r])));
                        _mm256_store_ps(tile[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dots[r][1], ones)),
                                                                     _mm256_mul_ps(s1, d), _mm256_load_ps(tile[r] + 8)));
                    }
                }
                const __m256 n0 = _mm256_loadu_ps(mw + (p * ng + g) * 16), n1 = _mm256_loadu_ps(mw + (p * ng + g) * 16 + 8);
                for (int r = 0; r < 4; r++) {
                    const __m256 s = _mm256_set1_ps(xs[(m0 + r) * ng + g]);
                    _mm256_store_ps(tile[r], _mm256_fmadd_ps(n0, s, _mm256_load_ps(tile[r])));
                    _mm256_store_ps(tile[r] + 8, _mm256_fmadd_ps(n1, s, _mm256_load_ps(tile[r] + 8)));
                }
            }
            const int64_t n0 = p * 16, count = N - n0 < 16 ? N - n0 : 16;
            for (int r = 0; r < 4 && m0 + r < M; r++) store_outputs(tile[r], count, bias, n0, y, (m0 + r) * N + n0, y_bf16);
        }
    }
}
#endif
"""
SOURCE = ROWS_SOURCE + GEMM_SOURCE
FLAGS = [*OPTIMIZE, "-fno-tree-reassoc"]

_libs: dict[bool, Optional[ctypes.CDLL]] = {}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def available() -> bool:
    """Whether the kernel runs here: an x86 CPU with AVX2 and FMA, and the library built."""
    return {"avx2", "fma"} <= cpu_flags() and load() is not None


def uses_vnni() -> bool:
    """Whether this CPU's build multiplies with AVX-512 VNNI (else AVX2)."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags() and available()


def load(avx2: bool = False) -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use for this CPU (its AVX-512 VNNI form where the
    CPU has it; `avx2`: the AVX2 form whatever the CPU, which the tests compare with it); None
    where it cannot be built."""
    if avx2 not in _libs:
        lib = None
        if {"avx2", "fma"} <= cpu_flags():
            flags = [*FLAGS, "-mno-avx512f", "-DW4A8_AVX2"] if avx2 else FLAGS
            lib = load_library("cpu_w4a8-avx2" if avx2 else "cpu_w4a8", SOURCE, flags)
        if lib is not None:
            lib.quantize_rows.argtypes = [_P, _I, _I, _I, _I, ctypes.c_int, _P, _P, _P]
            lib.w4a8_gemm.argtypes = [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, ctypes.c_int]
            lib.quantize_rows.restype = lib.w4a8_gemm.restype = None
        _libs[avx2] = lib
    return _libs[avx2]


class W4A8Weight:
    """An INT4 weight repacked for the kernel (still 4 bits a weight) and its float32 scales and
    mins; ``linear`` is ``x @ W.T (+ bias)`` with x quantized to int8 per row and block of 32."""

    def __init__(self, weight: Int4Weight):
        n, k, g = weight.out_features, weight.in_features, weight.group_size
        self.out_features, self.in_features, self.group_size = n, k, g
        self.padded_out = -(-n // TILE_OUT) * TILE_OUT
        q = torch.zeros(self.padded_out, k, dtype=torch.uint8)
        q[:n] = unpack_int4(weight.qweight)
        # [N/16, 16 outputs, K/32 blocks, 2 halves, 4 vectors L, 4 bytes j] -> [N/16, K/32, L, o, j, half]
        q = q.reshape(self.padded_out // 16, 16, k // BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        self.packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        self.scales = self._per_vector(weight.scales)
        self.mins = self._per_vector(weight.mins)

    def _per_vector(self, t: torch.Tensor) -> torch.Tensor:
        """float16 [N, K/G] -> float32 [Np/16, K/G, 16] (zeros for the padded outputs)."""
        out = torch.zeros(self.padded_out, t.shape[1])
        out[:self.out_features] = t.float()
        return out.reshape(self.padded_out // 16, 16, -1).transpose(1, 2).contiguous()

    def linear(self, x2d: torch.Tensor, bias: Optional[torch.Tensor] = None, avx2: bool = False) -> torch.Tensor:
        """`x2d` `[M, K]` float32 or bfloat16 -> `[M, N]` in x's dtype, + `bias` (`[N]`) when given;
        `avx2`: through the AVX2 form even where the CPU has AVX-512 VNNI (the same bits)."""
        assert x2d.dtype in (torch.float32, torch.bfloat16) and x2d.shape[1] == self.in_features
        x2d = x2d.contiguous()
        rows, k, g = x2d.shape[0], self.in_features, self.group_size
        padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
        xq = torch.empty(padded_rows, k, dtype=torch.int8)
        dx = torch.empty(padded_rows, k // BLOCK)
        xs = torch.empty(padded_rows, k // g)
        lib = load(avx2)
        lib.quantize_rows(x2d.data_ptr(), rows, padded_rows, k, g, int(x2d.dtype == torch.bfloat16),
                          xq.data_ptr(), dx.data_ptr(), xs.data_ptr())
        y = torch.empty(rows, self.out_features, dtype=x2d.dtype)
        if bias is not None:
            bias = bias.float().contiguous()
        lib.w4a8_gemm(xq.data_ptr(), dx.data_ptr(), xs.data_ptr(), rows, padded_rows, k, g,
                      self.packed.data_ptr(), self.scales.data_ptr(), self.mins.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), self.out_features,
                      self.padded_out, int(y.dtype == torch.bfloat16))
        return y

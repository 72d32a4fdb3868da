"""Q8_0 weights x int8 activations on the CPU (W8A8, as llama.cpp's Q8_0 x Q8_0): a C kernel of ours.

The weight is a GGUF's own Q8_0 blocks (int8 values, one scale per 32 input channels: the default
model's tied LM head is stored so), repacked once (``W8A8Weight``); each call quantizes its
activations to int8 per row and block of 32 exactly as the W4A8 kernel does (engine/quant/cpu_w4a8.py
``quantize_rows``: one float32 scale per row and block, the block's absolute maximum mapped to 127),
then

    y[i, n] = sum_b  (d[n, b] * dx[i, b]) * sum_{k in b} q[n, k] * xq[i, k]        (integer dot)

one float multiply-add per block (the two scales' product, then the FMA), in block order.

The integer dot is AVX-512 VNNI's ``vpdpbusd`` where the CPU has it: it multiplies unsigned by
signed bytes, so the activations go in as ``xq + 128`` (unsigned) against the signed weights and
each block's accumulators start at ``-128 * sum_k q[n, k]`` (kept beside the weight): the same
integer. Register tile: 4 rows x 32 outputs. Else AVX2: ``vpmaddubsw`` of ``|q|`` with ``xq``
carrying q's sign (``vpsignb``; a pair of products is at most 2 * 127 * 127, no int16 saturation),
``vpmaddwd`` by ones into int32, a tile of 4 rows x 16 outputs. Both forms compute the same integers
and the same float operations in the same order: the same bits (``load(avx2=True)`` builds the AVX2
form anywhere, for the tests).

Packed layout (``W8A8Weight.packed``): for each 16 outputs and each block of 32 input channels, eight
64-byte vectors; vector ``j`` holds, for output ``o``, the weights of input channels ``4j..4j+3``
(the four bytes one int32 lane of ``vpdpbusd`` sums; AVX2 reads each vector as two halves of 8
outputs). Scales float32 ``[N/16, K/32, 16]``, the accumulators' starts int32 the same shape.

Who uses it: the LM head where the checkpoint stores it as Q8_0 (engine/layers/q8_head.py), on
every call, of an INT4 model whose layers run the W4A8 kernel (every step of such a model already
quantizes its activations to int8; at a 256-row decode step the head is a third of the model's
multiply-adds), and of a full-precision model on the bf16 CPU math where it measured faster than
that math's head (layers/cpu_math.py ``choose_head``). The tile's two weight vectors are held in
registers for its four rows (GCC otherwise folds each into every row's ``vpdpbusd`` as a memory
operand: on a 2-core Zen 4, a 256-row call of the default model's head 24.3-24.6 -> 22.4-22.5 ms,
ad hoc; the same bits).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from nightshift.engine.cpu_features import cpu_flags
from nightshift.engine.kernels.c_library import load_library
from nightshift.engine.quant import cpu_w4a8

BLOCK = 32
TILE_ROWS = 4       # rows of one register tile (both forms)
TILE_OUT = 32       # outputs padded to a whole AVX-512 VNNI tile (two vectors of 16; AVX2's is 16)

GEMM_SOURCE = r"""
/* y [M, N] float32 = the W8A8 product. w: packed [Np/16, K/32, 8, 16, 4] int8; sw: float32
   [Np/16, K/32, 16]; start: int32 [Np/16, K/32, 16] (-128 * the block's sum of q); xq/dx from
   quantize_rows with Mp a multiple of 4; Np a multiple of 32. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(W8A8_AVX2)
void w8a8_gemm(const int8_t *xq, const float *dx, int64_t M, int64_t Mp, int64_t K,
               const int8_t *w, const float *sw, const int32_t *start, float *y, int64_t N, int64_t Np) {
    const int64_t nb = K / 32, quads = Np / 32, tiles = Mp / 4;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < quads; p++) {
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t v0 = 2 * p, m0 = 4 * t;       /* 16-output groups v0 and v0 + 1 */
            const int8_t *w0 = w + v0 * nb * 512, *w1 = w0 + nb * 512;
            __m512 f[4][2];
            for (int r = 0; r < 4; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m512i c0 = _mm512_loadu_si512((const void *)(start + (v0 * nb + b) * 16));
                const __m512i c1 = _mm512_loadu_si512((const void *)(start + ((v0 + 1) * nb + b) * 16));
                __m512i d[4][2];
                for (int r = 0; r < 4; r++) { d[r][0] = c0; d[r][1] = c1; }
                const int8_t *xb = xq + m0 * K + b * 32;
                for (int j = 0; j < 8; j++) {
                    __m512i q0 = _mm512_loadu_si512((const void *)(w0 + b * 512 + j * 64));
                    __m512i q1 = _mm512_loadu_si512((const void *)(w1 + b * 512 + j * 64));
                    __asm__("" : "+v"(q0), "+v"(q1));     /* in registers, not reloaded as each row's operand */
                    for (int r = 0; r < 4; r++) {
                        uint32_t xw;
                        memcpy(&xw, xb + r * K + 4 * j, 4);
                        const __m512i xu = _mm512_set1_epi32((int32_t)(xw ^ 0x80808080u));   /* xq + 128 */
                        d[r][0] = _mm512_dpbusd_epi32(d[r][0], xu, q0);
                        d[r][1] = _mm512_dpbusd_epi32(d[r][1], xu, q1);
                    }
                }
                const __m512 s0 = _mm512_loadu_ps(sw + (v0 * nb + b) * 16), s1 = _mm512_loadu_ps(sw + ((v0 + 1) * nb + b) * 16);
                for (int r = 0; r < 4; r++) {
                    const __m512 dd = _mm512_set1_ps(dx[(m0 + r) * nb + b]);
                    f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][0]), _mm512_mul_ps(s0, dd), f[r][0]);
                    f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][1]), _mm512_mul_ps(s1, dd), f[r][1]);
                }
            }
            const int64_t n0 = v0 * 16, count = N - n0 < 32 ? N - n0 : 32;
            for (int r = 0; r < 4 && m0 + r < M; r++) {
                float out[32];
                _mm512_storeu_ps(out, f[r][0]); _mm512_storeu_ps(out + 16, f[r][1]);
                store_outputs(out, count, NULL, n0, y, (m0 + r) * N + n0, 0);
            }
        }
    }
}
#else
/* AVX2: `vpmaddubsw` of |q| against xq with q's sign (pairs into int16, at most 2 * 127 * 127),
   `vpmaddwd` by ones into int32 lanes of four products, the same integers as VNNI's. Register
   tile: 4 rows x 16 outputs (two vectors of 8); the float tile lives in memory (L1). */
void w8a8_gemm(const int8_t *xq, const float *dx, int64_t M, int64_t Mp, int64_t K,
               const int8_t *w, const float *sw, const int32_t *start, float *y, int64_t N, int64_t Np) {
    const int64_t nb = K / 32, pairs = Np / 16, tiles = Mp / 4;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t t = 0; t < tiles; t++) {
            const __m256i ones = _mm256_set1_epi16(1);
            const int64_t m0 = 4 * t;
            const int8_t *wp = w + p * nb * 512;
            float tile[4][16] __attribute__((aligned(32)));
            memset(tile, 0, sizeof tile);
            __asm__ volatile("" : : "r"(tile) : "memory");
            for (int64_t b = 0; b < nb; b++) {
                __m256i d[4][2];
                for (int r = 0; r < 4; r++) d[r][0] = d[r][1] = _mm256_setzero_si256();
                const int8_t *xb = xq + m0 * K + b * 32;
                for (int j = 0; j < 8; j++) {
                    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(wp + b * 512 + j * 64));
                    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(wp + b * 512 + j * 64 + 32));
                    const __m256i a0 = _mm256_abs_epi8(q0), a1 = _mm256_abs_epi8(q1);
                    for (int r = 0; r < 4; r++) {
                        int32_t xw;
                        memcpy(&xw, xb + r * K + 4 * j, 4);
                        const __m256i xv = _mm256_set1_epi32(xw);
                        d[r][0] = _mm256_add_epi32(d[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, q0)), ones));
                        d[r][1] = _mm256_add_epi32(d[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, q1)), ones));
                    }
                }
                const __m256 s0 = _mm256_loadu_ps(sw + (p * nb + b) * 16), s1 = _mm256_loadu_ps(sw + (p * nb + b) * 16 + 8);
                for (int r = 0; r < 4; r++) {
                    const __m256 dd = _mm256_set1_ps(dx[(m0 + r) * nb + b]);
                    _mm256_store_ps(tile[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][0]), _mm256_mul_ps(s0, dd), _mm256_load_ps(tile[r])));
                    _mm256_store_ps(tile[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][1]), _mm256_mul_ps(s1, dd), _mm256_load_ps(tile[r] + 8)));
                }
            }
            const int64_t n0 = p * 16, count = N - n0 < 16 ? N - n0 : 16;
            for (int r = 0; r < 4 && m0 + r < M; r++) store_outputs(tile[r], count, NULL, n0, y, (m0 + r) * N + n0, 0);
        }
    }
}
#endif
"""
SOURCE = cpu_w4a8.ROWS_SOURCE + GEMM_SOURCE

_libs: dict[bool, Optional[ctypes.CDLL]] = {}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def available() -> bool:
    """Whether the kernel runs here: an x86 CPU with AVX2 and FMA, and the library built."""
    return {"avx2", "fma"} <= cpu_flags() and load() is not None


def load(avx2: bool = False) -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use for this CPU (its AVX-512 VNNI form where the CPU
    has it; `avx2`: the AVX2 form whatever the CPU, which the tests compare with it); None where it
    cannot be built."""
    if avx2 not in _libs:
        lib = None
        if {"avx2", "fma"} <= cpu_flags():
            flags = [*cpu_w4a8.FLAGS, "-mno-avx512f", "-DW8A8_AVX2"] if avx2 else cpu_w4a8.FLAGS
            lib = load_library("cpu_w8a8-avx2" if avx2 else "cpu_w8a8", SOURCE, flags)
        if lib is not None:
            lib.quantize_rows.argtypes = [_P, _I, _I, _I, _I, ctypes.c_int, _P, _P, _P]
            lib.w8a8_gemm.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _I]
            lib.quantize_rows.restype = lib.w8a8_gemm.restype = None
        _libs[avx2] = lib
    return _libs[avx2]


class W8A8Weight:
    """Q8_0 weights (int8 ``values`` ``[N, K]``, float32 ``scales`` ``[N, K/32]``) repacked for the
    kernel; ``linear`` is ``x @ W.T`` with x quantized to int8 per row and block of 32."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor):
        n, k = values.shape
        if values.dtype != torch.int8 or k % BLOCK or scales.shape != (n, k // BLOCK):
            raise ValueError(f"Q8_0 needs int8 values [N, K] (K a multiple of {BLOCK}) and scales [N, K/{BLOCK}], "
                             f"got {values.dtype} {tuple(values.shape)} and {tuple(scales.shape)}")
        self.out_features, self.in_features = n, k
        self.padded_out = -(-n // TILE_OUT) * TILE_OUT
        q = torch.zeros(self.padded_out, k, dtype=torch.int8)
        q[:n] = values
        # [N/16, 16 outputs, K/32 blocks, 8 vectors j, 4 bytes] -> [N/16, K/32, j, o, 4]
        self.packed = q.reshape(self.padded_out // 16, 16, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
        sums = q.reshape(self.padded_out, k // BLOCK, BLOCK).sum(-1, dtype=torch.int32)
        self.starts = self._per_vector(-128 * sums)
        padded_scales = torch.zeros(self.padded_out, k // BLOCK)
        padded_scales[:n] = scales.float()
        self.scales = self._per_vector(padded_scales)

    def _per_vector(self, t: torch.Tensor) -> torch.Tensor:
        """``[Np, K/32]`` -> ``[Np/16, K/32, 16]``."""
        return t.reshape(self.padded_out // 16, 16, -1).transpose(1, 2).contiguous()

    def linear(self, x2d: torch.Tensor, avx2: bool = False) -> torch.Tensor:
        """`x2d` `[M, K]` float32 or bfloat16 -> float32 `[M, N]`; `avx2`: through the AVX2 form
        even where the CPU has AVX-512 VNNI (the same bits)."""
        assert x2d.dtype in (torch.float32, torch.bfloat16) and x2d.dim() == 2 and x2d.shape[1] == self.in_features
        x2d = x2d.contiguous()
        rows, k = x2d.shape
        padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
        xq = torch.empty(padded_rows, k, dtype=torch.int8)
        dx = torch.empty(padded_rows, k // BLOCK)
        sums = torch.empty(padded_rows, 1)         # quantize_rows' group sums, one group of K: unused here
        lib = load(avx2)
        lib.quantize_rows(x2d.data_ptr(), rows, padded_rows, k, k, int(x2d.dtype == torch.bfloat16),
                          xq.data_ptr(), dx.data_ptr(), sums.data_ptr())
        y = torch.empty(rows, self.out_features)
        lib.w8a8_gemm(xq.data_ptr(), dx.data_ptr(), rows, padded_rows, k, self.packed.data_ptr(),
                      self.scales.data_ptr(), self.starts.data_ptr(), y.data_ptr(), self.out_features,
                      self.padded_out)
        return y

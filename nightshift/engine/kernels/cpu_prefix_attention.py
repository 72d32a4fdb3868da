"""Attention of many query rows over one shared prefix on AMX tiles: ``prefix_attention``.

In a batch whose prompts share a system prompt, every decode row of a step attends to the same
prefix blocks first. The paged kernel (kernels/cpu_paged_attention.py) does that row by row with
vector FMAs; here the prefix is one matrix product per KV head instead, on the CPU's AMX tiles
(Intel Sapphire Rapids and later: ``amx_bf16``): scores = Q K^T and output = softmax(scores) V
for 16 query vectors (rows x query heads of a KV head) at a time, the prefix's K and V repacked
once per call into the tiles' pair-interleaved layout. The paged kernel then attends each row's
own positions after the prefix and merges the two softmax parts
(``paged_attention_after_prefix``).

Precision: the tiles multiply bfloat16 pairs into float32 sums, the roundings of the paged
kernel's bfloat16 products (``cpu_paged_attention.bf16_products``, which every shape this kernel
runs has): the pool's K and V as stored, the scaled float32 query and the probabilities
exp(score - max) rounded to bfloat16 (to nearest even), the softmax sum and the log-sum-exp from the
float32 probabilities. (Until 2026-12-01 the query and the probabilities went as three bfloat16
parts each, float32's 24 bits, at three tile products each: exact to ~1e-6 but 1.6x the time, while
the positions after the prefix were rounded anyway; `bench.quality --maths bf16 --shared-system`
measured no drift from it, README "CPU math".) A row's result depends on whether its step shares the
prefix (not on the other rows' values).

Linux hands out AMX state only to a process that asks (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
``load()`` asks once and returns None where the CPU has no AMX, the request is refused or the
build fails (the caller keeps the paged kernel for the whole context). Head dims a multiple of 64.
NIGHTSHIFT_CPU_PREFIX_ATTENTION=0 turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

from nightshift.engine.cpu_features import cpu_flags
from nightshift.engine.kernels.c_library import EXP16_AVX512, OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 if this process may use the AMX tiles (asked of the kernel once; oneDNN asks the same) */
int amx_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

struct tilecfg { uint8_t palette; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

""" + EXP16_AVX512 + r"""
/* 16 floats rounded to bfloat16 (to nearest even), stored */
static inline void round16(__m512 x, uint16_t *to) { _mm256_storeu_si256((__m256i *)to, (__m256i)_mm512_cvtneps_pbh(x)); }

/* the pool element where prefix position p's vector `at` (a KV head's offset) starts; row = KVH * D */
static inline int64_t slot(const int32_t *prefix, int64_t p, int64_t bs, int64_t row, int64_t at) {
    return ((int64_t)prefix[p / bs] * bs + p % bs) * row + at;
}

/* q, out [n, KVH * GQ, D] float32; lse [n, KVH * GQ]; k_cache, v_cache [blocks, bs, KVH, D]
   bfloat16; prefix [nb] block ids: positions 0 .. P-1 (P = nb * bs) of every row. Per KV head the
   query vectors are its rows x GQ heads in order, 16 to a tile; P is padded to a multiple of 32
   (zero keys score and zero values add nothing: their probabilities are set to 0). */
void prefix_attention(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *prefix,
                      int64_t nb, int64_t n, int64_t KVH, int64_t GQ, int64_t D, int64_t bs, float scale,
                      float *out, float *lse) {
    const int64_t H = KVH * GQ, P = nb * bs, PP = (P + 31) & ~(int64_t)31, PT = PP / 16, DC = D / 32;
    const int64_t R = n * GQ, groups = (R + 15) / 16;
    /* K of head h as score tiles' B operand: [h][dc][pt] tiles of 16 rows (dim pairs) x 16 positions
       x 2; V as output tiles' B operand: [h][pc][dt] tiles of 16 rows (position pairs) x 16 dims x 2 */
    uint16_t *kb = (uint16_t *)calloc((size_t)KVH * DC * PT * 512, 2);
    uint16_t *vb = (uint16_t *)calloc((size_t)KVH * (PP / 32) * (D / 16) * 512, 2);
    /* 16 positions of a K tile in one block (block sizes a multiple of 16): gathered, each tile row
       (a dim pair of the 16 positions) at once; else one position at a time */
    const __m512i position_step = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                     _mm512_set1_epi32((int)(KVH * D / 2)));
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < KVH; h++)
        for (int64_t pt = 0; pt < PT; pt++) {        /* positions pt * 16 .. + 15 (padding stays 0) */
            const int64_t p0 = pt * 16;
            if (p0 >= P) continue;
            if (bs % 16 == 0) {
                const uint32_t *kp = (const uint32_t *)(k_cache + slot(prefix, p0, bs, KVH * D, h * D));
                for (int64_t dp = 0; dp < D / 2; dp++)
                    _mm512_storeu_si512(kb + ((h * DC + dp / 16) * PT + pt) * 512 + (dp % 16) * 32,
                                        _mm512_i32gather_epi32(_mm512_add_epi32(position_step, _mm512_set1_epi32((int)dp)),
                                                               (const void *)kp, 4));
            } else {
                for (int64_t c = 0; c < 16 && p0 + c < P; c++) {
                    const int64_t p = p0 + c;
                    const uint32_t *kp = (const uint32_t *)(k_cache + slot(prefix, p, bs, KVH * D, h * D));
                    uint32_t *kt = (uint32_t *)(kb + (h * DC * PT + pt) * 512) + c;
                    for (int64_t dp = 0; dp < D / 2; dp++) kt[(dp / 16) * PT * 256 + (dp % 16) * 16] = kp[dp];
                }
            }
            /* V: a tile row is two positions' values interleaved, 16 dims */
            for (int64_t p = p0; p < p0 + 16 && p < P; p += 2) {
                const uint16_t *va = v_cache + slot(prefix, p, bs, KVH * D, h * D);
                const uint16_t *vn = p + 1 < P ? v_cache + slot(prefix, p + 1, bs, KVH * D, h * D) : 0;
                uint16_t *vt = vb + ((h * (PP / 32) + p / 32) * (D / 16)) * 512 + ((p % 32) / 2) * 32;
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512i even = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(va + d)));
                    const __m512i odd = vn ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vn + d))), 16)
                                           : _mm512_setzero_si512();
                    _mm512_storeu_si512(vt + (d / 16) * 512, _mm512_or_si512(even, odd));
                }
            }
        }
    #pragma omp parallel
    {
        struct tilecfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
        _tile_loadconfig(&cfg);
        uint16_t *qa = (uint16_t *)aligned_alloc(64, (size_t)DC * 16 * 32 * 2);       /* [dc][16][32] */
        float *s = (float *)aligned_alloc(64, (size_t)16 * PP * 4);
        uint16_t *pa = (uint16_t *)aligned_alloc(64, (size_t)16 * PP * 2);           /* [16][PP] */
        float *o = (float *)aligned_alloc(64, (size_t)16 * D * 4);
        float m[16], l[16];
        #pragma omp for collapse(2) schedule(static)
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t gi = 0; gi < groups; gi++) {
                for (int r = 0; r < 16; r++) {
                    const int64_t v = gi * 16 + r;
                    const float *qv = v < R ? q + ((v / GQ) * H + h * GQ + v % GQ) * D : 0;
                    for (int64_t d = 0; d < D; d += 16)
                        round16(qv ? _mm512_mul_ps(_mm512_loadu_ps(qv + d), _mm512_set1_ps(scale)) : _mm512_setzero_ps(),
                                qa + (d / 32) * 512 + r * 32 + d % 32);
                }
                /* scores: tile 0 += q (1) x K (3), per 16 positions */
                for (int64_t pt = 0; pt < PT; pt++) {
                    _tile_zero(0);
                    for (int64_t dc = 0; dc < DC; dc++) {
                        _tile_loadd(1, qa + dc * 512, 64);
                        _tile_loadd(3, kb + ((h * DC + dc) * PT + pt) * 512, 64);
                        _tile_dpbf16ps(0, 1, 3);
                    }
                    _tile_stored(0, s + pt * 16, PP * 4);
                }
                /* softmax numerators, rounded to bfloat16 as the output product's A operand; their
                   float32 values summed */
                for (int r = 0; r < 16; r++) {
                    float *sr = s + r * PP;
                    for (int64_t p = P; p < PP; p++) sr[p] = -INFINITY;        /* padding: probability 0 */
                    __m512 mv = _mm512_set1_ps(-3.0e38f), tv = _mm512_setzero_ps();
                    for (int64_t p = 0; p < PP; p += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + p));
                    const float mr = _mm512_reduce_max_ps(mv);
                    for (int64_t p = 0; p < PP; p += 16) {
                        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + p), _mm512_set1_ps(mr)));
                        tv = _mm512_add_ps(tv, e);
                        round16(e, pa + r * PP + p);
                    }
                    m[r] = mr; l[r] = _mm512_reduce_add_ps(tv);
                }
                /* output: tiles 0-3 (16 dims each) += p (4) x V (6), per 32 positions */
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t pc = 0; pc < PP / 32; pc++) {
                        _tile_loadd(4, pa + pc * 32, PP * 2);
                        const uint16_t *vt = vb + ((h * (PP / 32) + pc) * (D / 16) + d0 / 16) * 512;
#define PV(c, at) _tile_loadd(6, vt + (at), 64); _tile_dpbf16ps(c, 4, 6);
                        PV(0, 0) PV(1, 512) PV(2, 2 * 512) PV(3, 3 * 512)
#undef PV
                    }
                    _tile_stored(0, o + d0, D * 4);
                    _tile_stored(1, o + d0 + 16, D * 4);
                    _tile_stored(2, o + d0 + 32, D * 4);
                    _tile_stored(3, o + d0 + 48, D * 4);
                }
                for (int r = 0; r < 16; r++) {
                    const int64_t v = gi * 16 + r;
                    if (v >= R) break;
                    const int64_t hg = (v / GQ) * H + h * GQ + v % GQ;
                    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps(out + hg * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv));
                    lse[hg] = m[r] + logf(l[r]);
                }
            }
        free(qa); free(s); free(pa); free(o);
        _tile_release();
    }
    free(kb); free(vb);
}
"""
FLAGS = [*OPTIMIZE, "-ffast-math", "-mamx-tile", "-mamx-bf16"]

@functools.cache
def load() -> Optional[ctypes.CDLL]:
    """The AMX prefix kernel, built on first use; None where the CPU has no AMX bf16, the kernel
    refuses this process the tiles, the build fails, or NIGHTSHIFT_CPU_PREFIX_ATTENTION=0."""
    if os.environ.get("NIGHTSHIFT_CPU_PREFIX_ATTENTION", "1") == "0" or not {"amx_bf16", "amx_tile"} <= cpu_flags():
        return None
    lib = load_library("prefix_attention_amx", SOURCE, FLAGS)
    if lib is None or not lib.amx_enable():
        return None
    lib.prefix_attention.restype = None
    lib.prefix_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float] + \
        [ctypes.c_void_p] * 2
    return lib


def supports(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether this CPU runs the prefix kernel for this shape: a bfloat16 pool, head dims a multiple of 64."""
    return kv_dtype == torch.bfloat16 and head_dim % 64 == 0 and num_heads % num_kv_heads == 0 and load() is not None


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_blocks: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[n, H, D]` float32 over the positions of ``prefix_blocks`` (int32 block ids) of the
    bfloat16 pool `[blocks, bs, KVH, D]` -> (output `[n, H, D]`, log of the softmax sum `[n, H]`)."""
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    lib = load()
    assert lib is not None and supports(heads, kv_heads, dim, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    assert prefix_blocks.dtype == torch.int32 and prefix_blocks.is_contiguous()
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(n, heads, dtype=torch.float32)
    if n:
        lib.prefix_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), prefix_blocks.data_ptr(),
                             prefix_blocks.numel(), n, kv_heads, heads // kv_heads, dim, block_size, scale,
                             out.data_ptr(), lse.data_ptr())
    return out, lse

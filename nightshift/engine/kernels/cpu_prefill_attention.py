"""Attention of a prefill chunk's rows as matrix products on AVX-512: ``prefill_attention``.

The rows of one sequence's prefill chunk all read the same K/V blocks. The paged kernel
(kernels/cpu_paged_attention.py) takes them one row at a time: per row and KV head each position's
dot product is summed across the vector's lanes (a transposing reduction), about a third of its
work, and its `vdpbf16ps` run at ~35% of what oneDNN's bf16 GEMMs reach on the same cores. Here a
register tile holds 16 rows of a query head, one row per lane: the scores of two positions at a
time are `vdpbf16ps` of the 16 rows' query dim pairs against each position's K dim pair broadcast
straight from the pool (one broadcast for up to three query heads of its KV head, as the GQA group
divides; each query vector loaded once for the step's positions); the softmax runs on those vectors
(each lane its row's maximum, exponentials and sum); the output, 16 dims at a time, is `vdpbf16ps`
of the rows' probabilities for two positions against the two positions' V values of a dim,
broadcast from a copy of the sequence's V for that KV head with position pairs interleaved (made
once per call and KV head, shared by all the chunk's tiles).

**A row gets the paged kernel's bits.** The same roundings (the scaled query and the unnormalized
probabilities rounded to bfloat16, K and V as stored, float32 sums) and the same order of every
float32 sum: each score is summed as the paged kernel's lanes and transposing reduction sum it (lane
l the dim pairs l, l + 16, ...; then its tree over the 16 lanes), the softmax total as its 16 lane
sums and their reduction tree, the output over position pairs in order as its value pass does
(`vdpbf16ps` gives the same products either way round). Compiled without -ffast-math, so that
the compiler keeps the sums in the order written. So whether a chunk goes here or to the paged
kernel (the backend decides by the chunk's length, so by the batch) never changes a bit, and a
row's result depends on that row alone. Only for even block sizes: the paged kernel pairs positions
within a block. A sliding window masks the positions before each row's window and reads nothing
before the run's first row's (those blocks may have been given back). This bfloat16 form needs a
CPU with AVX-512 BF16; head dims a multiple of 32 (``supports``); no soft-capping (the backend
keeps such layers on the paged kernel); NIGHTSHIFT_CPU_PREFILL_ATTENTION=0 turns it off.

**Over a float32 pool** (the float32 CPU math's, on any AVX-512 CPU: -DKV_F32) the same tiles take
the paged kernel's float32 form: the scaled query and the probabilities unrounded, each lane's dims
l, l + 16, ... by a multiply then multiply-adds, the same trees, the value pass position by position
against V read straight from the pool; again its bits on every row, so the float32 path's results
are those it had. On the Zen 5 below (float32 pool, paged kernel -> tiles): 1,024 rows after 1,024
23.0 -> 14.4 ms, 512 after 3,584 29.5 -> 18.9, a fresh 1,024-token prompt 6.4 -> 5.1, 16 chunks of 64
after 1,000 17.0-17.3 -> 13.3-13.7, but chunks of 32 after 260 3.75 -> 4.0: the backend tiles only
longer chunks over longer contexts there (attention/cpu_kernel_backend.py, F32_TILE_MIN_ROWS).

Measured (ad hoc, a 2-core AMD EPYC Zen 5, AVX-512 with avx512_bf16, 2 threads, the default
model's 9 query heads over 3 KV heads of 64, blocks of 16, the pool in cache), the paged kernel
against the tiles: the standard workload's prefill step (16 chunks of 57 rows after 208 cached
positions) 1.55-1.78 -> 1.20-1.30 ms, a fresh 1,024-token prompt 3.55-3.89 -> 2.27-2.38 ms, 1,024 rows
after 1,024 cached 11.6-12.2 -> 6.8-7.2 ms, 512 rows after 3,584 15.5-16.6 -> 8.6-8.8 ms, 32 chunks
of 32 rows after 260 2.0-2.4 -> 1.47-1.54 ms, 64 chunks of 16 after 260 2.1-2.8 -> 1.9-2.5 ms. The
first tiles summed each score over the dim pairs in turn and the softmax total over the positions
in turn (their own order: within ~1e-6 of the paged kernel, not its bits) and were ~15% faster
(1,024 after 1,024: 6.0-6.4 ms); one query head per tile at first (each K value broadcast once per
head), 7.33 ms there.
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
""" + EXP16_AVX512 + r"""
#define LANES 16          /* rows of one tile: one per lane */
/* query heads of one KV head a tile takes at once (GC, a divisor of the group GQ where one is small)
   and positions of one score step (SP, even): six (head, position) sums at a time either way */
#if GQ % 3 == 0
#define GC 3
#define SP 2
#elif GQ % 2 == 0
#define GC 2
#define SP 4
#else
#define GC 1
#define SP 6
#endif
#ifdef KV_F32            /* a float32 pool: float32 products, as the paged kernel's float32 form */
typedef float kv_t;
#define QW HD            /* the query's words a row: dims */
#define STEPS (HD / 16)  /* the paged kernel's multiply-adds a lane: dims l, l + 16, ... */
#else                    /* a bfloat16 pool: bfloat16 dim pairs (DOT_BF16) */
typedef uint16_t kv_t;
#define QW (HD / 2)      /* dim pairs */
#define STEPS (HD / 32)  /* dim pairs l, l + 16, ... */
#endif

/* the first position a row of length len sees (window: its last `window` positions; 0: all), made
   even: positions before a row's window are masked, never read past the run's first row's start */
static inline int64_t window_start(int64_t len, int64_t window) {
    const int64_t first = window > 0 && len > window ? len - window : 0;
    return first & ~(int64_t)1;
}

#ifndef KV_F32
static inline uint32_t bf16_bits(float f) {          /* round to nearest even, as cvtneps_pbh */
    uint32_t u; memcpy(&u, &f, 4);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* V of positions lo .. L-1 of KV head h (lo even) as position pairs: vi[(j - lo / 2) * HD + d] =
   V[2j][d] | V[2j+1][d] << 16 (the odd last position's partner 0) */
static void interleave_v(const uint16_t *v_cache, const int32_t *tab, int64_t lo, int64_t L, int64_t bs,
                         int64_t row, int64_t h, uint32_t *vi) {
    for (int64_t j = lo / 2; 2 * j < L; j++, vi += HD) {
        const int64_t p0 = 2 * j, p1 = 2 * j + 1;
        const uint16_t *a = v_cache + ((int64_t)tab[p0 / bs] * bs + p0 % bs) * row + h * HD;
        const uint16_t *b = p1 < L ? v_cache + ((int64_t)tab[p1 / bs] * bs + p1 % bs) * row + h * HD : 0;
        for (int d = 0; d < HD; d += 16) {
            const __m512i va = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d)));
            const __m512i vb = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                       _mm256_loadu_si256((const __m256i *)(b + d))), 16)
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(vi + d), _mm512_or_si512(va, vb));
        }
    }
}
#endif

/* The scores of SP positions (kp: each one's K dim pairs) for the GC query heads of a tile (qt: their
   scaled query dim pairs, one row a lane), each sum in the paged kernel's order
   (kernels/cpu_paged_attention.py, DOT_BF16; over a float32 pool its float32 form: dims instead of
   dim pairs, a multiply then multiply-adds), so a row gets the paged kernel's bits: its lane l takes
   the `vdpbf16ps` of dim pairs l, l + 16, ... in turn, and the 16 lanes are summed in the tree of its
   transposing reduction (fold4, then sum16_last): ((a0 + a2) + (a1 + a3)) within each group of four
   lanes, then (S0 + S1) + (S2 + S3) across the groups. Lanes go two at a time (x = a0 + a2, then
   y = a1 + a3) for every head and position, so each query vector is loaded once for the SP positions
   and each K pair broadcast once for the GC heads. */
static inline __attribute__((always_inline)) void lanes2(const uint32_t qt[GC][QW * LANES],
                                                        const uint32_t *const kp[SP], int l1, int l2,
                                                        __m512 x[GC][SP]) {
    __m512 a1[GC][SP], a2[GC][SP];
    for (int v = 0; v < STEPS; v++) {
        __m512 q1[GC], q2[GC];
        for (int g = 0; g < GC; g++) {
            q1[g] = _mm512_load_ps((const float *)(qt[g] + (16 * v + l1) * LANES));
            q2[g] = _mm512_load_ps((const float *)(qt[g] + (16 * v + l2) * LANES));
        }
        for (int j = 0; j < SP; j++) {
            const __m512i k1 = _mm512_set1_epi32((int)kp[j][16 * v + l1]);
            const __m512i k2 = _mm512_set1_epi32((int)kp[j][16 * v + l2]);
            for (int g = 0; g < GC; g++) {
#ifdef KV_F32            /* the first product alone, then multiply-adds (the paged kernel's _mm512_mul_ps, _fmadd_ps) */
                a1[g][j] = v ? _mm512_fmadd_ps(q1[g], _mm512_castsi512_ps(k1), a1[g][j]) : _mm512_mul_ps(q1[g], _mm512_castsi512_ps(k1));
                a2[g][j] = v ? _mm512_fmadd_ps(q2[g], _mm512_castsi512_ps(k2), a2[g][j]) : _mm512_mul_ps(q2[g], _mm512_castsi512_ps(k2));
#else
                if (!v) a1[g][j] = a2[g][j] = _mm512_setzero_ps();
                a1[g][j] = _mm512_dpbf16_ps(a1[g][j], (__m512bh)q1[g], (__m512bh)k1);
                a2[g][j] = _mm512_dpbf16_ps(a2[g][j], (__m512bh)q2[g], (__m512bh)k2);
#endif
            }
        }
    }
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < SP; j++) x[g][j] = _mm512_add_ps(a1[g][j], a2[g][j]);
}
static inline __attribute__((always_inline)) void dots(const uint32_t qt[GC][QW * LANES],
                                                      const uint32_t *const kp[SP], __m512 sc[GC][SP]) {
    __m512 grp[4][GC][SP];
    for (int k = 0; k < 4; k++) {
        __m512 x[GC][SP], y[GC][SP];
        lanes2(qt, kp, 4 * k, 4 * k + 2, x);
        lanes2(qt, kp, 4 * k + 1, 4 * k + 3, y);
        for (int g = 0; g < GC; g++)
            for (int j = 0; j < SP; j++) grp[k][g][j] = _mm512_add_ps(x[g][j], y[g][j]);
    }
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < SP; j++)
            sc[g][j] = _mm512_add_ps(_mm512_add_ps(grp[0][g][j], grp[1][g][j]), _mm512_add_ps(grp[2][g][j], grp[3][g][j]));
}

/* 16 partial sums -> their total in the tree of the paged kernel's `_mm512_reduce_add_ps` (GCC's):
   halves, quarters, then (0 + 2) + (1 + 3) */
static inline __m512 sum16(const __m512 part[16]) {
    __m512 h[8], q[4];
    for (int i = 0; i < 8; i++) h[i] = _mm512_add_ps(part[8 + i], part[i]);
    for (int i = 0; i < 4; i++) q[i] = _mm512_add_ps(h[4 + i], h[i]);
    return _mm512_add_ps(_mm512_add_ps(q[0], q[2]), _mm512_add_ps(q[1], q[3]));
}

/* One tile: rows first .. first + m - 1 (m <= 16) of one run, the query heads hg0 .. hg0 + gc - 1
   (gc <= GC) of KV head h: each K value broadcast once for all of them. s, pp: the thread's buffers
   for GC heads' scores [Lpad][16] and probability pairs [Lpad / 2][16]. */
static void tile(const float *q, const kv_t *k_cache, const kv_t *v_cache, const uint32_t *vi, const int32_t *tab,
                 const int32_t *lens, float *out, int64_t first, int64_t m, int64_t H, int64_t hg0, int gc,
                 int64_t h, int64_t bs, int64_t row, float scale, int64_t window, int64_t vlo, int64_t lpad,
                 float *s, uint32_t *pp) {
    uint32_t qt[GC][QW * LANES] __attribute__((aligned(64)));
    int32_t len[LANES] __attribute__((aligned(64)));
    for (int l = 0; l < LANES; l++) {
        const int64_t i = first + (l < m ? l : 0);       /* padding lanes repeat the first row */
        len[l] = lens[i];
        for (int g = 0; g < GC; g++) {
            const float *qi = q + (i * H + hg0 + (g < gc ? g : 0)) * HD;
#ifdef KV_F32
            for (int d = 0; d < HD; d++) { const float x = qi[d] * scale; memcpy(&qt[g][d * LANES + l], &x, 4); }
#else
            for (int p = 0; p < QW; p++)
                qt[g][p * LANES + l] = bf16_bits(qi[2 * p] * scale) | bf16_bits(qi[2 * p + 1] * scale) << 16;
#endif
        }
    }
    const int64_t L = lens[first + m - 1];               /* the tile's longest row: the run's lens grow */
    const int64_t lo = window_start(lens[first], window);  /* the tile's first row's first position (even) */
    const int64_t Lp = lo + (L - lo + SP - 1) / SP * SP;
    const __m512i lv = _mm512_load_si512((const void *)len);
    /* a lane's first position (a window: len - window; all: 0), for the mask */
    const __m512i fv = window > 0 ? _mm512_sub_epi32(lv, _mm512_set1_epi32((int)window)) : _mm512_set1_epi32(INT32_MIN);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx[GC];
    for (int g = 0; g < GC; g++) mx[g] = ninf;
    for (int64_t t0 = lo; t0 < Lp; t0 += SP) {
        const uint32_t *kp[SP];
        for (int j = 0; j < SP; j++) {
            const int64_t t = t0 + j < L ? t0 + j : L - 1;      /* past the tile's rows: masked */
            kp[j] = (const uint32_t *)(k_cache + ((int64_t)tab[t / bs] * bs + t % bs) * row + h * HD);
        }
        __m512 sc[GC][SP];
        dots(qt, kp, sc);
        for (int j = 0; j < SP; j++) {   /* positions at or past a row's length or before its window: -inf */
            const __m512i tv = _mm512_set1_epi32((int)(t0 + j));
            const __mmask16 in = _mm512_cmpgt_epi32_mask(lv, tv) & _mm512_cmple_epi32_mask(fv, tv);
            for (int g = 0; g < GC; g++) {
                const __m512 m = _mm512_mask_mov_ps(ninf, in, sc[g][j]);
                _mm512_store_ps(s + (g * lpad + t0 + j) * LANES, m);
                mx[g] = _mm512_max_ps(mx[g], m);
            }
        }
    }
    const int64_t pairs = (L + 1) / 2;               /* PV over pairs lo / 2 .. pairs - 1 */
    float o[16 * LANES] __attribute__((aligned(64)));
    for (int g = 0; g < gc; g++) {
        const float *sg = s + g * lpad * LANES;
        uint32_t *pg = pp + g * (lpad * LANES * sizeof(kv_t) / 4);
        /* the sum as the paged kernel adds it: position t into part t % 16, then those 16 in its tree */
        __m512 part[16];
        for (int j = 0; j < 16; j++) part[j] = _mm512_setzero_ps();
        for (int64_t c = lo & ~(int64_t)15; c < Lp; c += 16) {
            for (int j = 0; j < 16; j += 2) {
                const int64_t t = c + j;
                if (t < lo || t >= Lp) continue;
                const __m512 e0 = exp16(_mm512_sub_ps(_mm512_load_ps(sg + t * LANES), mx[g]));
                const __m512 e1 = exp16(_mm512_sub_ps(_mm512_load_ps(sg + (t + 1) * LANES), mx[g]));
                part[j] = _mm512_add_ps(part[j], e0);
                part[j + 1] = _mm512_add_ps(part[j + 1], e1);
#ifdef KV_F32                                  /* the probabilities as they are */
                _mm512_store_ps((float *)pg + t * LANES, e0);
                _mm512_store_ps((float *)pg + (t + 1) * LANES, e1);
#else                                          /* rounded to bfloat16, two positions a word */
                const __m512i b0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
                const __m512i b1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
                _mm512_store_si512((void *)(pg + (t / 2) * LANES), _mm512_or_si512(b0, _mm512_slli_epi32(b1, 16)));
#endif
            }
        }
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum16(part));
        for (int d0 = 0; d0 < HD; d0 += 16) {
            __m512 acc[16];
            for (int d = 0; d < 16; d++) acc[d] = _mm512_setzero_ps();
#ifdef KV_F32     /* position by position, V straight from the pool (the paged kernel's float32 value pass) */
            (void)vi; (void)vlo; (void)pairs;
            for (int64_t t = lo; t < L; t++) {
                const __m512 pv = _mm512_load_ps((const float *)pg + t * LANES);
                const float *vt = v_cache + ((int64_t)tab[t / bs] * bs + t % bs) * row + h * HD + d0;
                for (int d = 0; d < 16; d++) acc[d] = _mm512_fmadd_ps(pv, _mm512_set1_ps(vt[d]), acc[d]);
            }
#else             /* two positions a step against the sequence's V interleaved into position pairs */
            (void)v_cache;
            for (int64_t j = lo / 2; j < pairs; j++) {
                const __m512bh pv = (__m512bh)_mm512_load_si512((const void *)(pg + j * LANES));
                const uint32_t *vj = vi + (j - vlo / 2) * HD + d0;
                for (int d = 0; d < 16; d++)
                    acc[d] = _mm512_dpbf16_ps(acc[d], pv, (__m512bh)_mm512_set1_epi32((int)vj[d]));
            }
#endif
            for (int d = 0; d < 16; d++) _mm512_store_ps(o + d * LANES, _mm512_mul_ps(acc[d], inv));
            for (int l = 0; l < m; l++) {
                float *dst = out + ((first + l) * H + hg0 + g) * HD + d0;
                for (int d = 0; d < 16; d++) dst[d] = o[d * LANES + l];
            }
        }
    }
}

/* q [n, H, HD] float32 -> out [n, H, HD] for the rows of `runs` ([nruns, 2] int64: first row, rows):
   each run one sequence's chunk, its rows sharing the first row's table, lens growing by one a row.
   Pools [blocks, bs, KVH, HD] of kv_t (bfloat16, or float32 with KV_F32); other rows of out are left
   as they are. */
void prefill_attention(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *tables,
                       int64_t tw, const int32_t *lens, float *out, int64_t KVH, int64_t bs,
                       float scale, int64_t window, const int64_t *runs, int64_t nruns) {
    const int64_t H = KVH * GQ, row = KVH * HD;
    int64_t *voff = (int64_t *)malloc(sizeof(int64_t) * (nruns * KVH + 1));
    int64_t *rlo = (int64_t *)malloc(sizeof(int64_t) * nruns);     /* each run's first position read */
    int64_t items = 0, words = 0, lmax = 0;
    for (int64_t r = 0; r < nruns; r++) {
        const int64_t L = lens[runs[2 * r] + runs[2 * r + 1] - 1];
        lmax = L > lmax ? L : lmax;
        rlo[r] = window_start(lens[runs[2 * r]], window);
#ifndef KV_F32
        for (int64_t h = 0; h < KVH; h++) { voff[r * KVH + h] = words; words += ((L + 1) / 2 - rlo[r] / 2) * HD; }
#else
        for (int64_t h = 0; h < KVH; h++) voff[r * KVH + h] = 0;      /* no interleaved V: read from the pool */
#endif
        items += KVH * ((GQ + GC - 1) / GC) * ((runs[2 * r + 1] + LANES - 1) / LANES);
    }
    uint32_t *vi = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (words + 16));
    int64_t *work = (int64_t *)malloc(sizeof(int64_t) * 3 * (items + 1));
    int64_t w = 0;
    for (int64_t r = 0; r < nruns; r++)
        for (int64_t t = 0; t < runs[2 * r + 1]; t += LANES)
            for (int64_t h = 0; h < KVH; h++)       /* GC query heads of one KV head at a time */
                for (int64_t c = 0; c < GQ; c += GC, w++) {
                    work[3 * w] = r; work[3 * w + 1] = t; work[3 * w + 2] = h * GQ + c;
                }
    const int64_t lpad = (lmax + SP - 1) / SP * SP + SP;
    #pragma omp parallel
    {
#ifndef KV_F32
        #pragma omp for schedule(dynamic)
        for (int64_t x = 0; x < nruns * KVH; x++) {
            const int64_t r = x / KVH, h = x % KVH, first = runs[2 * r];
            interleave_v(v_cache, tables + first * tw, rlo[r], lens[first + runs[2 * r + 1] - 1], bs, row, h,
                         vi + voff[x]);
        }
#endif
        float *s = (float *)aligned_alloc(64, sizeof(float) * GC * lpad * LANES);
        /* the probabilities: float32 a position, or bfloat16 two positions a word */
        uint32_t *pp = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * GC * (lpad * LANES * sizeof(kv_t) / 4));
        #pragma omp for schedule(dynamic)
        for (int64_t x = 0; x < items; x++) {
            const int64_t r = work[3 * x], t = work[3 * x + 1], hg = work[3 * x + 2], h = hg / GQ;
            const int64_t first = runs[2 * r] + t, rows = runs[2 * r + 1] - t, left = (h + 1) * GQ - hg;
            tile(q, k_cache, v_cache, vi + voff[r * KVH + h], tables + runs[2 * r] * tw, lens, out, first,
                 rows < LANES ? rows : LANES, H, hg, left < GC ? (int)left : GC, h, bs, row, scale, window,
                 rlo[r], lpad, s, pp);
        }
        free(s); free(pp);
    }
    free(vi); free(work); free(voff); free(rlo);
}
"""
FLAGS = list(OPTIMIZE)      # no -ffast-math: the sums keep the order written (the paged kernel's)


@functools.cache
def load(group: int = 3, head_dim: int = 64, kv_dtype: torch.dtype = torch.bfloat16) -> Optional[ctypes.CDLL]:
    """The kernel for `group` query heads per KV head, `head_dim` (a multiple of 32) and a pool of
    `kv_dtype` (bfloat16: the bfloat16 products, on a CPU with AVX-512 BF16; float32: float32
    products, on any AVX-512 CPU), built on first use; None where the CPU has neither, the build
    fails, or NIGHTSHIFT_CPU_PREFILL_ATTENTION=0."""
    if kv_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the prefill tiles read a float32 or bfloat16 pool, not {kv_dtype}")
    f32 = kv_dtype == torch.float32
    needs = {"avx512f"} if f32 else {"avx512f", "avx512bw", "avx512_bf16"}
    if (os.environ.get("NIGHTSHIFT_CPU_PREFILL_ATTENTION", "1") == "0" or head_dim % 32 or group < 1
            or not needs <= cpu_flags()):
        return None
    name = f"prefill_attention-g{group}-d{head_dim}" + ("-f32" if f32 else "")
    lib = load_library(name, SOURCE, [*FLAGS, f"-DGQ={group}", f"-DHD={head_dim}", *(["-DKV_F32"] if f32 else [])])
    if lib is not None:
        lib.prefill_attention.restype = None
        lib.prefill_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    return lib


def supports(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, block_size: int) -> bool:
    """Whether this CPU runs the kernel for this shape: a bfloat16 pool on a CPU with AVX-512 BF16 or
    a float32 pool on one with AVX-512, head dims a multiple of 32, and an even block size (the paged kernel pairs a row's positions within a block for the
    bfloat16 products; tiles pair them from position 0: the same pairs only where blocks hold
    whole pairs)."""
    return (kv_dtype in (torch.bfloat16, torch.float32) and num_heads % num_kv_heads == 0 and head_dim <= 256
            and block_size % 2 == 0 and load(num_heads // num_kv_heads, head_dim, kv_dtype) is not None)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      lens: torch.Tensor, scale: float, runs: torch.Tensor, out: torch.Tensor,
                      window: Optional[int] = None) -> torch.Tensor:
    """Writes into ``out`` `[n, H, D]` the attention of the rows of ``runs`` (`[k, 2]` int64: first
    row, rows; each run one sequence's prefill chunk: its rows share the first row's table and
    their lens grow by one a row) over the bfloat16 or float32 pool; q `[n, H, D]` float32, tables `[n, w]`
    int32, lens `[n]` int32 as for cpu_paged_attention.paged_attention. Other rows are left alone.
    window: each row sees only its last `window` positions (table entries of blocks wholly before
    the run's first row's window are never read: the block manager may have given them back)."""
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    assert supports(heads, kv_heads, dim, k_cache.dtype, block_size) and v_cache.dtype == k_cache.dtype
    assert q.dtype == out.dtype == torch.float32 and out.shape == q.shape and out.is_contiguous()
    assert tables.dtype == lens.dtype == torch.int32 and tables.is_contiguous() and lens.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert runs.dtype == torch.int64 and runs.dim() == 2 and runs.shape[1] == 2
    if runs.shape[0] == 0:
        return out
    runs = runs.contiguous()
    first, count = runs[:, 0], runs[:, 1]
    assert int(count.min()) >= 1 and int((first + count).max()) <= n and int(first.min()) >= 0
    q = q.contiguous()
    load(heads // kv_heads, dim, k_cache.dtype).prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                                   tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(),
                                                   kv_heads, block_size, scale, window or 0, runs.data_ptr(),
                                                   runs.shape[0])
    return out

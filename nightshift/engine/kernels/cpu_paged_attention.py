"""Paged attention on CPU as a small C kernel: reads K/V straight from the pool's blocks.

The torch path (engine/attention/torch_paged.py) has to gather every sequence's K/V out of the
pool (index_select) before attending; on the benchmark workload that copy plus the attention calls
were ~40% of a float32 decode step. This kernel walks each query row's block table instead. One
work item is one row with all its heads (OpenMP over rows): a pass over the row's blocks computes
every head's scores (on AVX-512, 16 positions at a time, each position's K widened once for all
the query heads of its KV head, each query vector loaded once per four positions, one transposing
reduction for the 16 dot products), one exp pass per head, a second pass over the blocks
accumulates V in registers. Each thread takes every T-th row and, while it computes one, asks for
its next row's K/V blocks a few cache lines at a time (`struct ahead` in the source). Ad hoc
timings of a 256-row call over ~330 positions (a 13-block shared prefix, 3 KV heads of 64, bf16
pool) on a 2-core AMD EPYC Zen 5: taking each query vector once per four positions (not once per
position: the loads, not the multiplies, had bound the score pass) 1.17 -> 0.83 ms with every
block in cache (other head shapes 10-35%; the same bits); the walk ahead, each layer's pool in
memory as in a real run, 1.75 -> 1.12 ms.
Each block's K and V are read front to back (all KV heads of a position are one contiguous run).
A row's result depends on that row alone, so a lone request and the same request in a batch get
the same bits. A query row attends to positions 0..lens-1 of its sequence (its own K/V are stored
before the call), or with a sliding window to its last `window` of them, with scores soft-capped
where asked (Gemma 2/3, Mistral). CpuKernelAttention (engine/attention/cpu_kernel_backend.py)
sends it every row of a step, decode rows and prefill chunks alike.

At 256 rows of ~300 positions the kernel is bound by reading the rows' own K/V from memory (the
shared prefix stays in cache; merely reading the blocks of that call takes 0.67 ms): a pool of
bfloat16 K/V (what the fused bf16 layers use, models/fused_cpu_layer.py) halves that. Over a
float32 pool the arithmetic is float32. Over a bfloat16 pool on a CPU with AVX-512 BF16 (head dims
a multiple of 32) the products are bfloat16 dot products (`vdpbf16ps`, 32 multiply-adds an
instruction, the K/V read as stored), the scaled query and the probabilities rounded to bfloat16
as attention in bfloat16 does, the sums float32 (DOT_BF16 in the source; `bf16_products()` says
which build a shape got). On a 2-core AMD EPYC Zen 4, whose 512-bit FMAs run as two 256-bit halves
and where the float32 form was bound by its arithmetic, ad hoc: that 256-row call 1.43-1.50 ->
1.02-1.09 ms with every block in cache, 1.62-1.80 -> 1.40-1.52 ms with each layer's pool in
memory; `bench.engine --skip-hf --breakdown`, three pairs alternating: the run's attention 8.20 /
7.97 / 9.13 -> 6.84 / 7.17 / 7.96 s, output tok/s 791.9 / 807.6 / 747.6 -> 831.6 / 808.5 / 755.8.
`bench.quality --maths bf16` there: top-1 0.9761, mean KL 6.50e-04, greedy equal 46.9% (HF
bfloat16 0.9736 / 1.17e-03 / 39.1%).

Built on first use per (query heads per KV head, head dim, pool dtype) with the system C compiler
(`cc -O3 -march=native -fopenmp`, the first two as constants so the inner loops unroll) through
kernels/c_library.py (cached on disk by source hash, called through ctypes). AVX2 CPUs run the same
passes with 8-lane vectors (scores four positions at a time with one transposing reduction per
head, the values' accumulators in registers; head dims a multiple of 8): on a 2-core AMD EPYC Zen 3
the attention calls of a 256-row decode step over 220-390 positions (`bench.runner`'s, float32 pool)
took 255 -> 210 ms of its ~900 (ad hoc wrapper timings). Over a bfloat16 pool (the fused layers'),
where each K or V vector is widened before use, three query heads of a KV head take each vector
at once (its loads and widening shared; GC in the source): the same bits, and on a 2-core Zen 3 the
attention calls of that step with the W4A8 model (ad hoc, old and new kernel alternating in one
process) 143-159 -> 115-129 ms, the step 592-634 -> 543-612 ms; over a float32 pool sharing the
vectors gained nothing there, so it goes one head at a time. Other CPUs (and other head dims) run
the same loops in plain C. Where there is no compiler or the build fails, `load()` returns None
once and the backend selection keeps the torch path: nothing requires it. Queries float32;
NIGHTSHIFT_CPU_ATTENTION=0 turns it off.

``paged_attention_after_prefix`` is the same kernel for rows whose first ``start`` positions (a
prefix shared by a step's rows) were attended elsewhere (kernels/cpu_prefix_attention.py on AMX
tiles): it reads positions ``start`` onwards and starts each head's softmax sum and accumulator
from the prefix's log-sum-exp and output.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import NamedTuple, Optional

import torch

from nightshift.engine.cpu_features import cpu_family, cpu_vendor
from nightshift.engine.kernels.c_library import EXP16_AVX512, OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
""" + EXP16_AVX512 + r"""
/* GQ (query heads per KV head) and HD (head dim) are compile-time constants (-D), so the
   loops over them unroll and one (row, KV head)'s accumulators stay in registers. KV_BF16: the
   pool holds bfloat16 K/V (widened to float32 as they are read, the arithmetic float32, except where
   DOT_BF16 below multiplies them in bfloat16). */
#ifdef KV_BF16
typedef uint16_t kv_t;
static inline float kv_f32(kv_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
#else
typedef float kv_t;
static inline float kv_f32(kv_t x) { return x; }
#endif

#if defined(__AVX512F__) && HD % 16 == 0 && !defined(PORTABLE)
#define VEC 1
#define NV (HD / 16)
#if defined(KV_BF16) && defined(__AVX512BF16__) && HD % 32 == 0
/* bfloat16 dot products (vdpbf16ps: 32 multiply-adds into 16 float32 sums, the pool's K/V read as
   they are, no widening), the query and the probabilities rounded to bfloat16 first, as attention
   in bfloat16 (HF's own) does; the sums float32. Half the multiply instructions of the float32
   form and none of its widening: on a 2-core AMD EPYC Zen 4, whose 512-bit FMAs run as two 256-bit
   halves, the float32 form was bound by its arithmetic (kernels/README.md, Zen 4). The value
   pass takes two positions at once: their V vectors interleaved by 16-bit lanes
   (unpacklo/hi), so the accumulators hold a head's dims in the order ACC_AT gives. */
#define DOT_BF16 1
#define ACC_AT(d) (((d) & ~31) + (((d) >> 2) & 1) * 16 + (((d) & 31) >> 3) * 4 + ((d) & 3))
#endif
#ifdef KV_BF16
#define LOAD_KV(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#else
#define LOAD_KV(p) _mm512_loadu_ps(p)
#endif
/* Sixteen dot products' partial vectors v[0..15] -> one vector whose lane j is the sum of v[j]'s
   lanes (a transposing reduction: 45 shuffles and adds for 16 sums instead of 16 horizontal
   sums), in two parts: fold4 takes four of them through the first two stages (v[k]'s lanes summed
   into the k-th lane of each four-lane group), sum16_last the four folds through the rest. */
static inline __m512 fold4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512d a = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1)));
    const __m512d b = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3)));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
static inline __m512 sum16_last(const __m512 x[4]) {
    __m512 y[2];
    for (int k = 0; k < 2; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}
#elif defined(__AVX2__) && defined(__FMA__) && HD % 8 == 0 && !defined(PORTABLE)
/* AVX2: the same passes with 8-lane vectors, up to GC query heads of a KV head at a time, each K or
   V vector loaded once for all of them (16 ymm registers: GC x 4 score accumulators, or GC x VW
   value accumulators, plus the GC query vectors or probabilities and the K/V vector). Scores four
   positions at a time: each dot product's partial vector (HD / 8 multiply-adds) and one transposing
   reduction (sum4: lane p the sum of d[p]'s lanes) per head. Values: per head, VW of its HD / 8
   accumulator vectors in registers across the block's positions. */
#define VEC2 1
#define NV (HD / 8)
/* query heads at a time: a bfloat16 K/V vector is widened (two instructions) once for three heads;
   a float32 one is an FMA's memory operand, and sharing it gained nothing (the registers it takes
   cost more: ad hoc timings on a Zen 3) */
#ifdef KV_BF16
#define GC 3
#else
#define GC 1
#endif
#define VW(gc) ((gc) == 1 ? 8 : (15 - (gc)) / (gc))   /* value accumulators per head at a time */
#ifdef KV_BF16
#define LOAD_KV(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#else
#define LOAD_KV(p) _mm256_loadu_ps(p)
#endif
static inline __m128 sum4(__m256 d0, __m256 d1, __m256 d2, __m256 d3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(d0, d1), _mm256_hadd_ps(d2, d3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
/* the scores of positions kp, kp + row, ... (c of them, c <= 4; the others' lanes 0) for the gc
   query heads at q (HD apart), into s[g * stride + 0..3] */
static inline __attribute__((always_inline)) void scores4(const int gc, const int c, const float *q,
                                                          const kv_t *kp, int64_t row, float *s,
                                                          int64_t stride) {
    __m256 d[GC][4];
    for (int g = 0; g < gc; g++)
        for (int p = 0; p < 4; p++) d[g][p] = _mm256_setzero_ps();
    for (int v = 0; v < NV; v++) {
        __m256 qv[GC];
        for (int g = 0; g < gc; g++) qv[g] = _mm256_loadu_ps(q + g * HD + 8 * v);
        for (int p = 0; p < c; p++) {
            const __m256 kv = LOAD_KV(kp + p * row + 8 * v);
            for (int g = 0; g < gc; g++) d[g][p] = _mm256_fmadd_ps(qv[g], kv, d[g][p]);
        }
    }
    for (int g = 0; g < gc; g++) _mm_storeu_ps(s + g * stride, sum4(d[g][0], d[g][1], d[g][2], d[g][3]));
}
static inline __attribute__((always_inline)) void scores_block(const int gc, int64_t cnt, const float *q,
                                                               const kv_t *kb, int64_t row, float *s,
                                                               int64_t stride) {
    int64_t j0 = 0;
    for (; j0 + 4 <= cnt; j0 += 4) scores4(gc, 4, q, kb + j0 * row, row, s + j0, stride);
    if (j0 < cnt) {
        const int c = (int)(cnt - j0);
        if (c == 1) scores4(gc, 1, q, kb + j0 * row, row, s + j0, stride);
        else if (c == 2) scores4(gc, 2, q, kb + j0 * row, row, s + j0, stride);
        else scores4(gc, 3, q, kb + j0 * row, row, s + j0, stride);
    }
}
#endif

#ifndef ACC_AT
#define ACC_AT(d) (d)        /* where dim d of a head's output accumulates */
#endif

/* The rows' own K/V blocks are scattered through a pool of gigabytes, so a decode call is bound by
   reading them from memory. Each thread takes every T-th row (static schedule) and, while it works
   on one row, walks through the K and V blocks of its next one, a few 64-byte lines at a time
   (QK_LINES per block of the score pass, PV_LINES per position and KV head of the value pass),
   asking for them ahead of use. A burst of prefetches for a whole row at once, or for the next
   block only, is mostly dropped by the CPU (its miss buffers are full) and gained nothing; spread
   like this, a 256-row call over ~330 positions, each layer's pool in memory (not cache), took 1.75
   -> 1.12 ms on a 2-core AMD EPYC Zen 5 (ad hoc), against 0.78 ms with everything in cache and 0.67
   ms to merely read the blocks. Blocks the row before it reads too (a shared prefix; a prefill
   chunk's own sequence) are skipped: they are in cache already. On Zen 4 the lines go to L2 only
   (prefetcht2): into L1 (prefetcht0) they held the L1's few miss buffers that the row being
   computed needs, and the prefetch instructions themselves stalled. On a 2-core AMD EPYC Zen 4 (the
   pool on huge pages, in memory), with 16 lines per block of the score pass into L1 as before, then
   4 into L2: ad hoc, the same call 2.46 -> 1.85 ms (1.55 ms with every block in cache);
   `bench.engine --skip-hf`, the attention calls of the run 12.0 / 11.7 -> 9.4 / 9.7 s, output tok/s
   719.2 / 699.4 -> 730.1 / 726.7 (alternating). How many lines per step pays depends on the core:
   QK_LINES, PV_LINES and the hint (PF_HINT: 1 prefetcht2, 3 prefetcht0) come from prefetch_plan()
   (-D flags). On a 2-core Intel Xeon with AMX
   (pool on huge pages, 30 layers' pools in memory, 256 rows after a 208-position shared prefix), ad
   hoc: 4 / 1 1.78-1.87 ms a call, 8 / 2 1.67, 16 / 4 1.52-1.55, 24 / 3 1.58, 32 / 6 1.65, no
   prefetch 2.55 (the same rows with every block in L2: 0.81 ms; merely reading the blocks: 0.92
   ms); `bench.engine --skip-hf` alternating, the run's after-prefix calls 6.89 / 6.97 -> 6.34 /
   6.32 s. On a 2-core AMD EPYC Zen 5 (the same call, 30 layers' pools in memory, 324 positions on
   average): 4 / 1 into L2 1.17-1.23 ms, 16 / 1 into L2 1.11, into L1 4 / 1 1.12-1.14, 8 / 1
   1.09, **16 / 1 1.05-1.07**, 24 / 1 1.07, 32 / 1 1.08; 4 / 2 1.51 (its walk is done early in the
   value pass), 36 / 0 1.16; with every block in cache 0.83. */
struct ahead { const int32_t *tab, *prev; int64_t b, nb, nprev, o; };
static inline void ahead_start(struct ahead *a, const int32_t *tables, int64_t tw, const int32_t *lens,
                               int64_t r, int64_t n, int64_t bs, int64_t window, int64_t start) {
    a->b = a->nb = a->o = 0;
    if (r <= 0 || r >= n) return;
    const int64_t L = lens[r];
    a->tab = tables + r * tw; a->prev = tables + (r - 1) * tw;
    a->nb = (L + bs - 1) / bs; a->nprev = (lens[r - 1] + bs - 1) / bs;
    a->b = window > 0 && L > window ? (L - window) / bs : 0;
    if (start / bs > a->b) a->b = start / bs;
}
static inline void ahead_step(struct ahead *a, const char *k, const char *v, int64_t block_bytes, int lines) {
    while (lines > 0 && a->b < a->nb) {
        if (a->o == 0 && a->b < a->nprev && a->prev[a->b] == a->tab[a->b]) { a->b++; continue; }
        const int64_t at = (int64_t)a->tab[a->b] * block_bytes + a->o;
        __builtin_prefetch(k + at, 0, PF_HINT);
        __builtin_prefetch(v + at, 0, PF_HINT);
        lines--;
        if ((a->o += 64) >= block_bytes) { a->o = 0; a->b++; }
    }
}
#ifdef VEC2
/* acc[g * HD + 8 * v] (g < gc, v < w) += the sum over the block's cnt positions j of
   s[g * stride + j] * V[j]'s vector v; `walk`: this call walks the next row's blocks ahead */
static inline __attribute__((always_inline)) void values_block(const int gc, const int w, int64_t cnt,
                                                               const float *s, int64_t stride,
                                                               const kv_t *vb, int64_t row, float *acc,
                                                               struct ahead *next, const char *k_cache,
                                                               const char *v_cache, int64_t block_bytes,
                                                               int walk) {
    __m256 av[GC][8];
    for (int g = 0; g < gc; g++)
        for (int v = 0; v < w; v++) av[g][v] = _mm256_loadu_ps(acc + g * HD + 8 * v);
    for (int64_t j = 0; j < cnt; j++) {
        if (walk) ahead_step(next, k_cache, v_cache, block_bytes, PV_LINES);
        __m256 p[GC];
        for (int g = 0; g < gc; g++) p[g] = _mm256_set1_ps(s[g * stride + j]);
        const kv_t *vp = vb + j * row;
        for (int v = 0; v < w; v++) {
            const __m256 vv = LOAD_KV(vp + 8 * v);
            for (int g = 0; g < gc; g++) av[g][v] = _mm256_fmadd_ps(p[g], vv, av[g][v]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int v = 0; v < w; v++) _mm256_storeu_ps(acc + g * HD + 8 * v, av[g][v]);
}
/* one block of one KV head, every query head of it: GC heads at a time (the last chunk GQ % GC),
   VW of their accumulator vectors at a time (the last chunk the rest) */
#define GC_LAST (GQ % GC ? GQ % GC : GC)
static inline __attribute__((always_inline)) void values_heads(int64_t cnt, const float *s, int64_t stride,
                                                               const kv_t *vb, int64_t row, float *acc,
                                                               struct ahead *next, const char *k_cache,
                                                               const char *v_cache, int64_t block_bytes) {
    for (int g0 = 0; g0 < GQ; g0 += GC) {
        const int full = GQ - g0 >= GC;
#define VALUES_CHUNKS(gc) \
        for (int v0 = 0; v0 < NV; v0 += VW(gc)) { \
            const int walk = g0 == 0 && v0 == 0; \
            if (NV - v0 >= VW(gc)) \
                values_block(gc, VW(gc), cnt, s + g0 * stride, stride, vb + 8 * v0, row, acc + g0 * HD + 8 * v0, \
                             next, k_cache, v_cache, block_bytes, walk); \
            else \
                values_block(gc, NV % VW(gc), cnt, s + g0 * stride, stride, vb + 8 * v0, row, \
                             acc + g0 * HD + 8 * v0, next, k_cache, v_cache, block_bytes, walk); \
        }
        if (full) { VALUES_CHUNKS(GC) } else { VALUES_CHUNKS(GC_LAST) }
#undef VALUES_CHUNKS
    }
}
#endif
/* q, out [n, KVH * GQ, HD]; k_cache, v_cache [blocks, bs, KVH, HD]; tables [n, tw] (block ids
   of each row's sequence); lens [n]: row i attends to positions 0 .. lens[i]-1. Work item = one
   row, all its heads: the scores of every head first, block by block (each block's K read once,
   front to back: every KV head's slice of a position is one contiguous run), one exp pass per
   head, then V the same way. A row's result depends on that row alone (the same arithmetic
   whatever rows share the call).
   start > 0 (a multiple of bs, below every lens[i]; no window): positions 0 .. start-1 were
   attended elsewhere (a shared prefix), their normalized output in pre_out [n, KVH * GQ, HD] and
   the log of their softmax sum (max included) in pre_lse [n, KVH * GQ]: each head's sum and
   accumulator start from them, so the result is attention over all lens[i] positions. */
static void attention_rows(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                           const int32_t *tables, int64_t tw, const int32_t *lens, float *out,
                           int64_t n, int64_t KVH, int64_t bs, float scale, int64_t window, float softcap,
                           int64_t start, const float *pre_out, const float *pre_lse) {
    const int64_t H = KVH * GQ, row = KVH * HD;
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    const int64_t stride = (max_len + 31) & ~(int64_t)15;    /* one head's scores, whole vectors */
    #pragma omp parallel if (n > 1)       /* one row is one work item: no team to wake for it */
    {
        float *scores = (float *)malloc(sizeof(float) * H * stride);
        float *qs = (float *)malloc(sizeof(float) * H * HD), *acc = (float *)malloc(sizeof(float) * H * HD);
#ifdef DOT_BF16        /* the query and the probabilities as bfloat16 */
        uint16_t *qb = (uint16_t *)malloc(sizeof(uint16_t) * H * HD), *pb = (uint16_t *)malloc(sizeof(uint16_t) * H * stride);
#endif
        const int64_t T = omp_get_num_threads(), block_bytes = bs * row * sizeof(kv_t);
        struct ahead next;
        #pragma omp for schedule(static, 1)
        for (int64_t i = 0; i < n; i++) {
            ahead_start(&next, tables, tw, lens, i + T, n, bs, window, start);
            const int64_t L = lens[i], nb = (L + bs - 1) / bs;
            /* a window: only positions first .. L-1 (blocks before first's are never read: the
               block manager may have given them back); a prefix attended elsewhere: from start */
            const int64_t first = window > 0 && L > window ? L - window : start, b0 = first / bs;
            const int32_t *tab = tables + i * tw;
            for (int64_t d = 0; d < H * HD; d++) { qs[d] = q[i * H * HD + d] * scale; acc[d] = 0.f; }
#ifdef DOT_BF16
            for (int64_t d = 0; d < H * HD; d += 32)      /* round to nearest even, in order */
                _mm512_storeu_si512((void *)(qb + d), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qs + d + 16),
                                                                               _mm512_loadu_ps(qs + d)));
#endif
            for (int64_t b = b0; b < nb; b++) {
                const int64_t t0 = b * bs, cnt = L - t0 < bs ? L - t0 : bs;
                /* the next row's blocks on their way while this one computes (struct ahead) */
                ahead_step(&next, (const char *)k_cache, (const char *)v_cache, block_bytes, QK_LINES);
                for (int64_t h = 0; h < KVH; h++) {
                    const kv_t *kb = k_cache + (int64_t)tab[b] * bs * row + h * HD;
#ifdef VEC
                    for (int64_t j0 = 0; j0 < cnt; j0 += 16) {
                        const int64_t c = cnt - j0 < 16 ? cnt - j0 : 16;
                        /* every query head of this KV head at once, four positions at a time: each
                           position's K widened once (not once per head), each query vector loaded
                           once per four positions, and the four positions' dot products folded by
                           the first two stages of the transposing reduction at once (fold4, then
                           sum16_last: the same operations in the same order as one head and
                           sixteen positions at a time, so the same bits as before; with DOT_BF16
                           the products are bfloat16 dot products of K as stored, nothing widened) */
                        __m512 quarter[GQ][4];
                        for (int jq = 0; jq < 16; jq += 4) {
#ifdef DOT_BF16
                            __m512i kv[4][HD / 32];
                            for (int p = 0; p < 4; p++) {
                                const kv_t *kp = kb + (j0 + jq + p) * row;
                                for (int v = 0; v < HD / 32; v++)
                                    kv[p][v] = jq + p < c ? _mm512_loadu_si512((const void *)(kp + 32 * v)) : _mm512_setzero_si512();
                            }
                            for (int g = 0; g < GQ; g++) {
                                const uint16_t *qg = qb + (h * GQ + g) * HD;
                                __m512 d[4];
                                for (int p = 0; p < 4; p++) d[p] = _mm512_setzero_ps();
                                for (int v = 0; v < HD / 32; v++) {
                                    const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qg + 32 * v));
                                    for (int p = 0; p < 4; p++) d[p] = _mm512_dpbf16_ps(d[p], qv, (__m512bh)kv[p][v]);
                                }
                                quarter[g][jq / 4] = fold4(d[0], d[1], d[2], d[3]);
                            }
#else
                            __m512 kv[4][NV];
                            for (int p = 0; p < 4; p++) {
                                const kv_t *kp = kb + (j0 + jq + p) * row;
                                for (int v = 0; v < NV; v++) kv[p][v] = jq + p < c ? LOAD_KV(kp + 16 * v) : _mm512_setzero_ps();
                            }
                            for (int g = 0; g < GQ; g++) {
                                const float *qg = qs + (h * GQ + g) * HD;
                                __m512 d[4];
                                const __m512 q0 = _mm512_loadu_ps(qg);
                                for (int p = 0; p < 4; p++) d[p] = _mm512_mul_ps(q0, kv[p][0]);
                                for (int v = 1; v < NV; v++) {
                                    const __m512 qv = _mm512_loadu_ps(qg + 16 * v);
                                    for (int p = 0; p < 4; p++) d[p] = _mm512_fmadd_ps(qv, kv[p][v], d[p]);
                                }
                                quarter[g][jq / 4] = fold4(d[0], d[1], d[2], d[3]);
                            }
#endif
                        }
                        for (int g = 0; g < GQ; g++)
                            _mm512_storeu_ps(scores + (h * GQ + g) * stride + t0 + j0, sum16_last(quarter[g]));
                    }
#elif defined(VEC2)
                    for (int g0 = 0; g0 < GQ; g0 += GC) {
                        const float *qg = qs + (h * GQ + g0) * HD;
                        float *s = scores + (h * GQ + g0) * stride + t0;
                        if (GQ - g0 >= GC) scores_block(GC, cnt, qg, kb, row, s, stride);
                        else scores_block(GC_LAST, cnt, qg, kb, row, s, stride);
                    }
#else
                    for (int64_t j = 0; j < cnt; j++) {
                        const kv_t *kp = kb + j * row;
                        for (int g = 0; g < GQ; g++) {
                            const float *qg = qs + (h * GQ + g) * HD;
                            float dot = 0.f;
                            #pragma omp simd reduction(+:dot)
                            for (int d = 0; d < HD; d++) dot += qg[d] * kv_f32(kp[d]);
                            scores[(h * GQ + g) * stride + t0 + j] = dot;
                        }
                    }
#endif
                }
            }
            float l[H];
            const int64_t s0 = b0 * bs;                   /* the scores written: s0 .. L-1 */
            for (int64_t hg = 0; hg < H; hg++) {
                float *sg = scores + hg * stride, total = 0.f, mg = -3.0e38f;
                if (softcap > 0.f)                        /* soft-capping: softcap * tanh(score / softcap) */
                    for (int64_t t = first; t < L; t++) sg[t] = softcap * tanhf(sg[t] / softcap);
                for (int64_t t = s0; t < first; t++) sg[t] = -INFINITY;
                for (int64_t t = first; t < L; t++) mg = sg[t] > mg ? sg[t] : mg;
                if (pre_lse && pre_lse[i * H + hg] > mg) mg = pre_lse[i * H + hg];
                const int64_t padded = (L + 15) & ~(int64_t)15;      /* whole vectors: no scalar tail */
                for (int64_t t = L; t < padded; t++) sg[t] = -INFINITY;
#ifdef VEC
                __m512 tv = _mm512_setzero_ps();
                const int64_t v0 = s0 & ~(int64_t)15;               /* whole vectors from below s0 too */
                for (int64_t t = v0; t < s0; t++) sg[t] = -INFINITY;
                for (int64_t t = v0; t < padded; t += 16) {
                    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), _mm512_set1_ps(mg)));
                    _mm512_storeu_ps(sg + t, e);
#ifdef DOT_BF16
                    _mm256_storeu_si256((__m256i *)(pb + hg * stride + t), (__m256i)_mm512_cvtneps_pbh(e));
#endif
                    tv = _mm512_add_ps(tv, e);
                    __asm__("" : "+v"(tv));   /* position t into lane t % 16, in order: -ffast-math may not
                                                  re-associate it (the prefill tiles add in this order) */
                }
                total = _mm512_reduce_add_ps(tv);
#else
                #pragma omp simd reduction(+:total)
                for (int64_t t = s0; t < padded; t++) { sg[t] = expf(sg[t] - mg); total += sg[t]; }
#endif
                if (pre_lse) {        /* the prefix: weight exp(lse - max), its normalized output */
                    const float w = expf(pre_lse[i * H + hg] - mg);
                    const float *po = pre_out + (i * H + hg) * HD;
                    total += w;
                    for (int d = 0; d < HD; d++) acc[hg * HD + ACC_AT(d)] = w * po[d];
                }
                l[hg] = total;
            }
            for (int64_t b = b0; b < nb; b++) {
                const int64_t t0 = b * bs, cnt = L - t0 < bs ? L - t0 : bs;
                for (int64_t h = 0; h < KVH; h++) {
                    const kv_t *vb = v_cache + (int64_t)tab[b] * bs * row + h * HD;
#ifdef VEC
                    __m512 av[GQ][NV];
                    for (int g = 0; g < GQ; g++)
                        for (int v = 0; v < NV; v++) av[g][v] = _mm512_loadu_ps(acc + (h * GQ + g) * HD + 16 * v);
#ifdef DOT_BF16
                    for (int64_t j = 0; j < cnt; j += 2) {      /* positions j and j + 1 at once */
                        ahead_step(&next, (const char *)k_cache, (const char *)v_cache, block_bytes, 2 * PV_LINES);
                        const kv_t *vp = vb + j * row;
                        const int two = j + 1 < cnt;
                        __m512i vv[NV];
                        for (int v = 0; v < NV; v += 2) {
                            const __m512i a = _mm512_loadu_si512((const void *)(vp + 16 * v));
                            const __m512i b = two ? _mm512_loadu_si512((const void *)(vp + row + 16 * v)) : _mm512_setzero_si512();
                            vv[v] = _mm512_unpacklo_epi16(a, b);
                            vv[v + 1] = _mm512_unpackhi_epi16(a, b);
                        }
                        for (int g = 0; g < GQ; g++) {
                            const uint16_t *pg = pb + (h * GQ + g) * stride + t0 + j;
                            const uint32_t pair = (uint32_t)pg[0] | (two ? (uint32_t)pg[1] << 16 : 0u);
                            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
                            for (int v = 0; v < NV; v++) av[g][v] = _mm512_dpbf16_ps(av[g][v], p, (__m512bh)vv[v]);
                        }
                    }
#else
                    for (int64_t j = 0; j < cnt; j++) {
                        ahead_step(&next, (const char *)k_cache, (const char *)v_cache, block_bytes, PV_LINES);
                        const kv_t *vp = vb + j * row;
                        __m512 vv[NV];
                        for (int v = 0; v < NV; v++) vv[v] = LOAD_KV(vp + 16 * v);
                        for (int g = 0; g < GQ; g++) {
                            const __m512 p = _mm512_set1_ps(scores[(h * GQ + g) * stride + t0 + j]);
                            for (int v = 0; v < NV; v++) av[g][v] = _mm512_fmadd_ps(p, vv[v], av[g][v]);
                        }
                    }
#endif
                    for (int g = 0; g < GQ; g++)
                        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + (h * GQ + g) * HD + 16 * v, av[g][v]);
#elif defined(VEC2)
                    values_heads(cnt, scores + h * GQ * stride + t0, stride, vb, row, acc + h * GQ * HD, &next,
                                 (const char *)k_cache, (const char *)v_cache, block_bytes);
#else
                    for (int64_t j = 0; j < cnt; j++) {
                        ahead_step(&next, (const char *)k_cache, (const char *)v_cache, block_bytes, PV_LINES);
                        const kv_t *vp = vb + j * row;
                        for (int g = 0; g < GQ; g++) {
                            float *ag = acc + (h * GQ + g) * HD;
                            const float p = scores[(h * GQ + g) * stride + t0 + j];
                            #pragma omp simd
                            for (int d = 0; d < HD; d++) ag[d] += p * kv_f32(vp[d]);
                        }
                    }
#endif
                }
            }
            for (int64_t hg = 0; hg < H; hg++) {
                const float inv = 1.f / l[hg];
                float *o = out + (i * H + hg) * HD;
                for (int d = 0; d < HD; d++) o[d] = acc[hg * HD + ACC_AT(d)] * inv;
            }
        }
        free(scores); free(qs); free(acc);
#ifdef DOT_BF16
        free(qb); free(pb);
#endif
    }
}

int bf16_products(void) {     /* whether this build multiplies in bfloat16 (DOT_BF16) */
#ifdef DOT_BF16
    return 1;
#else
    return 0;
#endif
}

void paged_attention_f32(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                         const int32_t *tables, int64_t tw, const int32_t *lens, float *out,
                         int64_t n, int64_t KVH, int64_t bs, float scale, int64_t window, float softcap) {
    attention_rows(q, k_cache, v_cache, tables, tw, lens, out, n, KVH, bs, scale, window, softcap, 0, 0, 0);
}

void paged_attention_after_prefix(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                                  const int32_t *tables, int64_t tw, const int32_t *lens, float *out,
                                  int64_t n, int64_t KVH, int64_t bs, float scale, int64_t start,
                                  const float *pre_out, const float *pre_lse) {
    attention_rows(q, k_cache, v_cache, tables, tw, lens, out, n, KVH, bs, scale, 0, 0.f, start, pre_out, pre_lse);
}
"""
MAX_GROUP, MAX_HEAD_DIM = 16, 256      # one row's GQ x HD accumulators are registers (spilled beyond)
FLAGS = [*OPTIMIZE, "-ffast-math"]
KV_DTYPES = (torch.float32, torch.bfloat16)     # what the pool may hold

_lock = threading.Lock()
_libs: dict[tuple, Optional[ctypes.CDLL]] = {}


class PrefetchPlan(NamedTuple):
    """How a row walks its next row's K/V blocks ahead of use (`struct ahead` in the kernel source):
    lines per block of the score pass and per position and KV head of the value pass (each line
    one of K and one of V), and the prefetch hint (``__builtin_prefetch`` locality: 1 is
    prefetcht2, into L2; 3 is prefetcht0, into L1)."""
    qk_lines: int
    pv_lines: int
    hint: int


def prefetch_plan() -> PrefetchPlan:
    """The walk that measured fastest on this kind of core (the kernel source's comment has the
    figures): Intel 16 / 4 into L2 (Xeons with AMX; other Intel cores not measured), AMD Zen 5
    (family 26) 16 / 1 into L1, anything else 4 / 1 into L2 (AMD Zen 4, where 16 lines into L1
    were 30% slower, and Zen 3)."""
    if cpu_vendor() == "GenuineIntel":
        return PrefetchPlan(16, 4, 1)
    if cpu_vendor() == "AuthenticAMD" and cpu_family() >= 26:
        return PrefetchPlan(16, 1, 3)
    return PrefetchPlan(4, 1, 1)


def load(group: int = 3, head_dim: int = 64, portable: bool = False,
         kv_dtype: torch.dtype = torch.float32) -> Optional[ctypes.CDLL]:
    """The kernel library for `group` query heads per KV head, `head_dim` and a pool of
    `kv_dtype` K/V, built on first use; None if unavailable (no compiler, build failed) or
    disabled. `portable`: the plain C loops only (what a CPU without AVX-512 or AVX2 runs; the tests
    check both builds)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"the CPU attention kernel reads float32 or bfloat16 K/V, not {kv_dtype}")
    shape = (group, head_dim, portable, kv_dtype)
    if shape in _libs:
        return _libs[shape]
    with _lock:
        if shape in _libs:
            return _libs[shape]
        _libs[shape] = None
        if os.environ.get("NIGHTSHIFT_CPU_ATTENTION", "1") == "0":
            return None
        plan = prefetch_plan()
        flags = [*FLAGS, f"-DGQ={group}", f"-DHD={head_dim}", f"-DQK_LINES={plan.qk_lines}",
                 f"-DPV_LINES={plan.pv_lines}", f"-DPF_HINT={plan.hint}"]
        flags += (["-DPORTABLE"] if portable else []) + (["-DKV_BF16"] if kv_dtype == torch.bfloat16 else [])
        lib = load_library(f"paged_attention-g{group}-d{head_dim}", SOURCE, flags)
        if lib is not None:
            fn = lib.paged_attention_f32
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
                [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float]
            lib.bf16_products.restype = ctypes.c_int
            lib.bf16_products.argtypes = []
            fn = lib.paged_attention_after_prefix
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
                [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        _libs[shape] = lib
        return lib


def bf16_products(group: int = 3, head_dim: int = 64, portable: bool = False,
                  kv_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel for this shape multiplies in bfloat16 (vdpbf16ps, the query and the
    probabilities rounded to bfloat16; the kernel source's DOT_BF16): over a bfloat16 pool on a CPU
    with AVX-512 BF16, head dims a multiple of 32. False where the kernel does not build."""
    lib = load(group, head_dim, portable, kv_dtype)
    return lib is not None and bool(lib.bf16_products())


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can run this shape (and builds); any block size works."""
    group = num_heads // num_kv_heads
    return (dtype == torch.float32 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and load(group, head_dim) is not None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, portable: bool = False, window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """q `[n, H, D]` float32 -> `[n, H, D]`; tables `[n, w]` int32 block ids, lens `[n]` int32;
    the pool's K/V float32 or bfloat16. window: each row sees only its last `window` positions
    (itself included; table entries of blocks wholly before them are never read); softcap: scores
    (after scale) become softcap * tanh(score / softcap)."""
    if (window is not None and window <= 0) or (softcap is not None and softcap <= 0):
        raise ValueError(f"window and softcap must be positive, got {window}, {softcap}")
    return _run("paged_attention_f32", q, k_cache, v_cache, tables, lens, scale, portable, window or 0, softcap or 0.0)


def paged_attention_after_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 tables: torch.Tensor, lens: torch.Tensor, scale: float, start: int,
                                 prefix_out: torch.Tensor, prefix_lse: torch.Tensor) -> torch.Tensor:
    """``paged_attention`` of rows whose first ``start`` positions (a multiple of the block size,
    below every row's length) were attended elsewhere: ``prefix_out`` `[n, H, D]` their normalized
    output, ``prefix_lse`` `[n, H]` the log of their softmax sum; the kernel reads positions
    ``start`` onwards and merges (no window, no soft-capping)."""
    n, heads, _ = q.shape
    block_size = k_cache.shape[1]
    if start % block_size or (n and int(lens.min()) <= start):
        raise ValueError(f"a prefix of {start} positions must be whole blocks of {block_size} below every row's length")
    assert prefix_out.shape == q.shape and prefix_lse.shape == (n, heads)
    assert prefix_out.dtype == prefix_lse.dtype == torch.float32
    prefix_out, prefix_lse = prefix_out.contiguous(), prefix_lse.contiguous()
    return _run("paged_attention_after_prefix", q, k_cache, v_cache, tables, lens, scale, False, start,
                prefix_out.data_ptr(), prefix_lse.data_ptr())


def _run(entry: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
         lens: torch.Tensor, scale: float, portable: bool, *tail) -> torch.Tensor:
    """The library's ``entry`` over the rows (the checks and buffers both entry points share);
    ``tail``: the entry's own arguments after ``scale``."""
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.dtype == v_cache.dtype
    lib = load(heads // kv_heads, dim, portable, k_cache.dtype)
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    getattr(lib, entry)(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
                        lens.data_ptr(), out.data_ptr(), n, kv_heads, block_size, scale, *tail)
    return out

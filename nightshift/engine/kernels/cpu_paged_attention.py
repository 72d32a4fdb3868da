"""Paged attention on CPU as a small C kernel: reads K/V straight from the pool's blocks.

The torch path (engine/attention/torch_paged.py) has to gather every sequence's K/V out of the
pool (index_select) before attending; on the benchmark workload that copy plus the attention calls
were ~40% of a float32 decode step. This kernel walks each query row's block table instead:
one pass over the row's positions computes the scores of the query heads of one KV head, a
second accumulates V with the softmax weights. Rows are independent (OpenMP over rows x KV
heads); a query row attends to positions 0..lens-1 of its sequence (its own K/V are stored
before the call). CpuKernelAttention (engine/attention/cpu_kernel_backend.py) sends it decode
rows only.

Built on first use per (query heads per KV head, head dim) with the system C compiler
(`cc -O3 -march=native -fopenmp`, the two as constants so the inner loops unroll) through
kernels/c_library.py (cached on disk by source hash, called through ctypes). Where there is no
compiler or the build fails, `load()` returns None once and the backend selection keeps the
torch path: nothing requires it. Float32 only (the CPU dtype where it matters); NIGHTSHIFT_CPU_ATTENTION=0 turns it off.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch

from nightshift.engine.kernels.c_library import OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GQ (query heads per KV head) and HD (head dim) are compile-time constants (-D), so the
   loops over them unroll and one (row, KV head)'s accumulators stay in registers. */

/* q, out [n, KVH * GQ, HD]; k_cache, v_cache [blocks, bs, KVH, HD]; tables [n, tw] (block ids
   of each row's sequence); lens [n]: row i attends to positions 0 .. lens[i]-1. Work item =
   (row, KV head): all scores first (K read once), one exp pass over them, then V (read once). */
void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *tables, int64_t tw, const int32_t *lens, float *out,
                         int64_t n, int64_t KVH, int64_t bs, float scale) {
    const int64_t H = KVH * GQ, row = KVH * HD;
    int64_t max_len = 1;
    for (int64_t i = 0; i < n; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    #pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * GQ * max_len);
        #pragma omp for schedule(dynamic, 4)
        for (int64_t w = 0; w < n * KVH; w++) {
            const int64_t i = w / KVH, h = w % KVH;
            float qs[GQ][HD], acc[GQ][HD], m[GQ], l[GQ];
            const int64_t L = lens[i];
            const int32_t *tab = tables + i * tw;
            const float *qi = q + (i * H + h * GQ) * HD;
            for (int g = 0; g < GQ; g++) {
                m[g] = -3.0e38f;
                for (int d = 0; d < HD; d++) { qs[g][d] = qi[g * HD + d] * scale; acc[g][d] = 0.f; }
            }
            for (int64_t t = 0; t < L; t++) {
                const float *kp = k_cache + ((int64_t)tab[t / bs] * bs + t % bs) * row + h * HD;
                for (int g = 0; g < GQ; g++) {
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int d = 0; d < HD; d++) dot += qs[g][d] * kp[d];
                    scores[g * L + t] = dot;
                    m[g] = dot > m[g] ? dot : m[g];
                }
            }
            for (int g = 0; g < GQ; g++) {
                float *sg = scores + g * L, total = 0.f;
                const float mg = m[g];
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < L; t++) { sg[t] = expf(sg[t] - mg); total += sg[t]; }
                l[g] = total;
            }
            for (int64_t t = 0; t < L; t++) {
                const float *vp = v_cache + ((int64_t)tab[t / bs] * bs + t % bs) * row + h * HD;
                for (int g = 0; g < GQ; g++) {
                    const float p = scores[g * L + t];
                    #pragma omp simd
                    for (int d = 0; d < HD; d++) acc[g][d] += p * vp[d];
                }
            }
            for (int g = 0; g < GQ; g++) {
                const float inv = 1.f / l[g];
                float *o = out + (i * H + h * GQ + g) * HD;
                for (int d = 0; d < HD; d++) o[d] = acc[g][d] * inv;
            }
        }
        free(scores);
    }
}
"""
MAX_GROUP, MAX_HEAD_DIM = 16, 256      # qs/acc live on the stack: GQ * HD floats each
FLAGS = [*OPTIMIZE, "-ffast-math"]

_lock = threading.Lock()
_libs: dict[tuple[int, int], Optional[ctypes.CDLL]] = {}


def load(group: int = 3, head_dim: int = 64) -> Optional[ctypes.CDLL]:
    """The kernel library for `group` query heads per KV head and `head_dim`, built on first
    use; None if unavailable (no compiler, build failed) or disabled."""
    shape = (group, head_dim)
    if shape in _libs:
        return _libs[shape]
    with _lock:
        if shape in _libs:
            return _libs[shape]
        _libs[shape] = None
        if os.environ.get("NIGHTSHIFT_CPU_ATTENTION", "1") == "0":
            return None
        lib = load_library(f"paged_attention-g{group}-d{head_dim}", SOURCE,
                           [*FLAGS, f"-DGQ={group}", f"-DHD={head_dim}"])
        if lib is not None:
            fn = lib.paged_attention_f32
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
                [ctypes.c_int64] * 3 + [ctypes.c_float]
        _libs[shape] = lib
        return lib


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can run this shape (and builds); any block size works."""
    group = num_heads // num_kv_heads
    return (dtype == torch.float32 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and load(group, head_dim) is not None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[n, H, D]` float32 -> `[n, H, D]`; tables `[n, w]` int32 block ids, lens `[n]` int32."""
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    lib = load(heads // kv_heads, dim)
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    lib.paged_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                            tables.shape[1], lens.data_ptr(), out.data_ptr(), n, kv_heads, block_size, scale)
    return out


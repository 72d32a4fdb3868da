"""Paged attention on CPU as a small C kernel: reads K/V straight from the pool's blocks.

The torch path (engine/attention.py) has to gather every sequence's K/V out of the pool
(index_select) before attending; on the benchmark workload that copy plus the attention calls
were ~40% of a float32 decode step. This kernel walks each query row's block table instead:
one pass over the row's positions computes the scores of the query heads of one KV head, a
second accumulates V with the softmax weights. Rows are independent (OpenMP over rows x KV
heads), so decode rows and short prefill chunks go through the same call: a query row at
position p attends to positions 0..p of its sequence (its own K/V are stored before the call).

Built on first use with the system C compiler (`cc -O3 -march=native -fopenmp`), cached on
disk by source hash under ~/.cache/nightshift/cpu_kernels (or $NIGHTSHIFT_KERNEL_CACHE), and
called through ctypes (no torch headers, no ninja). Where there is no compiler or the build
fails, `load()` returns None once and the runner keeps the torch path: nothing requires it.
Float32 only (the CPU dtype where it matters); NIGHTSHIFT_CPU_ATTENTION=0 turns it off.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 64
#define MAX_DIM 256
#define MAX_BLOCK 64

/* q, out [n, H, D]; k_cache, v_cache [blocks, bs, KVH, D]; tables [n, tw] (block ids of each
   row's sequence); lens [n]: row i attends to positions 0 .. lens[i]-1 of its sequence.
   One row at a time, all heads together, block by block with an online softmax: every K/V
   row of the pool is read once per query row, and everything else stays in L1. */
void paged_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *tables, int64_t tw, const int32_t *lens, float *out,
                         int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale) {
    const int64_t G = H / KVH, row = KVH * D;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {
        float acc[MAX_HEADS * MAX_DIM], qs[MAX_HEADS * MAX_DIM], s[MAX_HEADS][MAX_BLOCK];
        float m[MAX_HEADS], l[MAX_HEADS];
        const int64_t L = lens[i];
        const int32_t *tab = tables + i * tw;
        const float *qi = q + i * H * D;
        for (int64_t x = 0; x < H * D; x++) { qs[x] = qi[x] * scale; acc[x] = 0.f; }
        for (int64_t h = 0; h < H; h++) { m[h] = -3.0e38f; l[h] = 0.f; }
        for (int64_t start = 0; start < L; start += bs) {
            const int64_t nt = L - start < bs ? L - start : bs;
            const float *kb = k_cache + (int64_t)tab[start / bs] * bs * row;
            const float *vb = v_cache + (int64_t)tab[start / bs] * bs * row;
            for (int64_t t = 0; t < nt; t++)
                for (int64_t h = 0; h < KVH; h++) {
                    const float *kp = kb + t * row + h * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qg = qs + (h * G + g) * D;
                        float dot = 0.f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < D; d++) dot += qg[d] * kp[d];
                        s[h * G + g][t] = dot;
                    }
                }
            for (int64_t hh = 0; hh < H; hh++) {
                float bm = m[hh];
                for (int64_t t = 0; t < nt; t++) bm = s[hh][t] > bm ? s[hh][t] : bm;
                const float corr = expf(m[hh] - bm);
                float total = 0.f;
                #pragma omp simd reduction(+:total)
                for (int64_t t = 0; t < nt; t++) { s[hh][t] = expf(s[hh][t] - bm); total += s[hh][t]; }
                l[hh] = l[hh] * corr + total;
                m[hh] = bm;
                if (corr != 1.f) {
                    float *a = acc + hh * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] *= corr;
                }
            }
            for (int64_t t = 0; t < nt; t++)
                for (int64_t h = 0; h < KVH; h++) {
                    const float *vp = vb + t * row + h * D;
                    for (int64_t g = 0; g < G; g++) {
                        const float p = s[h * G + g][t];
                        float *a = acc + (h * G + g) * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] += p * vp[d];
                    }
                }
        }
        float *o = out + i * H * D;
        for (int64_t hh = 0; hh < H; hh++) {
            const float inv = 1.f / l[hh];
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) o[hh * D + d] = acc[hh * D + d] * inv;
        }
    }
}
"""
MAX_HEADS, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 64      # the kernel's fixed buffers
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("NIGHTSHIFT_KERNEL_CACHE") or Path.home() / ".cache" / "nightshift" / "cpu_kernels"
    return Path(root)


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "paged_attention.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(src), "-o", str(out), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders each write their own temp file


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, building it on first use; None if unavailable or disabled."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("NIGHTSHIFT_CPU_ATTENTION", "1") == "0":
            return None
        key = hashlib.sha256("\0".join([SOURCE, *FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
        target = cache_dir() / f"paged_attention-{key}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
            fn = lib.paged_attention_f32
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
                [ctypes.c_int64] * 5 + [ctypes.c_float]
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            warnings.warn(f"CPU paged-attention kernel unavailable, using the torch path: {err}")
        return _lib


def supports(dtype: torch.dtype, num_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernel can run this shape (and is built)."""
    return (dtype == torch.float32 and num_heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK and load() is not None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[n, H, D]` float32 -> `[n, H, D]`; tables `[n, w]` int32 block ids, lens `[n]` int32."""
    lib = load()
    n, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == torch.float32
    lib.paged_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                            tables.shape[1], lens.data_ptr(), out.data_ptr(), n, heads, kv_heads, dim,
                            block_size, scale)
    return out


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""

"""Each row's argmax on the CPU as a small C kernel: the greedy rows' tokens from their logits.

torch's ``argmax(dim=-1)`` over a 256-row step's logits (256 x 49,152 float32) took 15-17 ms on
a 2-core Xeon (AVX-512), ``max(dim=-1).indices`` 12 ms: 2.3 s of a 55 s ``bench.engine`` run (the
sampler's greedy rows, every step). Reading each row once at memory speed takes a few ms. This
kernel runs the rows in parallel (OpenMP), each in two passes over the row (it stays in L2): the
vectorized maximum, then the first index that holds it. Its answer is torch's, ties and NaN
included: the first maximal index, or the first NaN's where a row has one. Rows of bfloat16 (the
logits of a greedy step from the CPU's bf16 LM head, engine/models/llama.py ``project_logits``)
are widened as they are read: the answer over their float32 values, reading half the bytes.

Built on first use with the system C compiler through kernels/c_library.py, like the other CPU
kernels; ``load()`` is None where that fails, and the sampler keeps torch's argmax.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from nightshift.engine.kernels.c_library import OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>

#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
/* x [n, v] (ELEM float32 or bfloat16, VALUE(p) its float32 value) -> out [n] int64: each row's
   first maximal index, or its first NaN's */
#define ROW_ARGMAX(name, ELEM, VALUE)                                                               \
void name(const ELEM *x, int64_t n, int64_t v, int64_t *out) {                                      \
    _Pragma("omp parallel for schedule(static) if (n > 1)")                                         \
    for (int64_t i = 0; i < n; i++) {                                                               \
        const ELEM *r = x + i * v;                                                                  \
        float m = -INFINITY;                                                                        \
        int nan = 0;                                                                                \
        _Pragma("omp simd reduction(max:m) reduction(|:nan)")                                       \
        for (int64_t j = 0; j < v; j++) { const float e = VALUE(r[j]); m = e > m ? e : m; nan |= e != e; } \
        int64_t k = 0;                                                                              \
        if (nan) { while (VALUE(r[k]) == VALUE(r[k])) k++; }                                        \
        else { while (k < v - 1 && VALUE(r[k]) != m) k++; }                                         \
        out[i] = k;                                                                                 \
    }                                                                                               \
}
#define AS_FLOAT(e) (e)
ROW_ARGMAX(row_argmax, float, AS_FLOAT)
ROW_ARGMAX(row_argmax_bf16, uint16_t, bf16_to_f32)
"""
FLAGS = OPTIMIZE       # no -ffast-math: NaN must stay NaN

_lib: Optional[ctypes.CDLL] = None
_loaded = False


def load() -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use; None where it cannot be built."""
    global _lib, _loaded
    if not _loaded:
        lib = load_library("cpu_argmax", SOURCE, FLAGS)
        if lib is not None:
            for fn in (lib.row_argmax, lib.row_argmax_bf16):
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                fn.restype = None
        _lib, _loaded = lib, True
    return _lib


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a `[n, v]` tensor, the same answer; the kernel for float32 or
    bfloat16 CPU tensors where it builds, torch's argmax otherwise."""
    lib = load()
    if (lib is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2
            or x.shape[1] == 0):
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    kernel = lib.row_argmax if x.dtype == torch.float32 else lib.row_argmax_bf16
    kernel(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out

"""Each row's argmax on the CPU as a small C kernel: the greedy rows' tokens from their logits.

torch's ``argmax(dim=-1)`` over a 256-row step's logits (256 x 49,152 float32) took 15-17 ms on
a 2-core Xeon (AVX-512), ``max(dim=-1).indices`` 12 ms: 2.3 s of a 55 s ``bench.engine`` run (the
sampler's greedy rows, every step). Reading each row once at memory speed takes a few ms. This
kernel runs the rows in parallel (OpenMP), each in two passes over the row (it stays in L2): the
vectorized maximum, then the first index that holds it. Its answer is torch's, ties and NaN
included: the first maximal index, or the first NaN's where a row has one.

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

/* x [n, v] float32 -> out [n] int64: each row's first maximal index, or its first NaN's */
void row_argmax(const float *x, int64_t n, int64_t v, int64_t *out) {
    #pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * v;
        float m = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max:m) reduction(|:nan)
        for (int64_t j = 0; j < v; j++) { m = r[j] > m ? r[j] : m; nan |= r[j] != r[j]; }
        int64_t k = 0;
        if (nan) { while (r[k] == r[k]) k++; }
        else { while (k < v - 1 && r[k] != m) k++; }
        out[i] = k;
    }
}
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
            lib.row_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.row_argmax.restype = None
        _lib, _loaded = lib, True
    return _lib


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a `[n, v]` tensor, the same answer; the kernel for contiguous
    float32 CPU tensors where it builds, torch's argmax otherwise."""
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.row_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out

"""RoPE and the K/V store of a float32 torch layer in one C pass, bit for bit as the torch ops.

The torch decoder layer (models/llama.py ``Attention.forward``) on the float32 CPU math rotates its
q and k heads with five tensor ops (``apply_rope``: a negation, a concatenation, two products and a
sum, each a pass over the step's q and k) and then copies k and v into the paged K/V pool with
two ``index_copy_`` calls, which torch runs on one thread. ``rope_store`` does all of it in one
pass over each row, rows in parallel (OpenMP): q rotated into a new contiguous tensor (what the
attention kernel reads), k rotated and v copied straight into the pool at the rows' slots.

Exactly the same operations in float32, in the same order (``x * cos - x' * sin`` and
``x' * cos + x * sin``, each product rounded, then the sum: the rotated half's negation is exact,
and torch's elementwise ops do not fuse a product into a sum), so it is compiled without
``-ffast-math`` and with ``-ffp-contract=off`` (no fused multiply-add): the same bits as the torch
path, which the float32 path keeps (tests/engine/test_cpu_exact_rope.py checks them). Partial rotary
(Phi-3) copies the dimensions past the rotary ones unchanged, as ``apply_rope`` does.

Used by CpuKernelAttention (engine/attention/cpu_kernel_backend.py, ``rope_store``) for float32 q,
k, v and pool; the fused bf16 layers have their own (kernels/cpu_fused_ops.py, which also rounds
to bfloat16). On a 2-core AMD EPYC Zen 3 (AVX2), the standard 256-row decode step of the default
model on the float32 math (ad hoc wrapper timings, `bench.runner`'s step): the 30 layers' RoPE and
K/V store 12.2 + 5.6 ms with the torch ops, 6.1 ms in this pass, of a ~650 ms step.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from nightshift.engine.kernels.c_library import OPTIMIZE, load_library

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* one head: o = x rotated by its first R dims (x * cos + rotate_half(x) * sin), the rest copied */
static inline void rotate(const float *restrict x, const float *restrict c, const float *restrict s,
                          float *restrict o, int64_t R, int64_t D) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) o[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int64_t i = half; i < R; i++) o[i] = x[i] * c[i] + x[i - half] * s[i];
    for (int64_t i = R; i < D; i++) o[i] = x[i];
}

/* qk [T, H + KVH, D] (row t at qk + t * qk_stride), v [T, KVH, D] (row t at v + t * v_stride);
   cos, sin [T, R]; q_out [T, H, D]; k_cache, v_cache [slots, KVH, D] */
void rope_store(const float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos_t,
                const float *sin_t, const int64_t *slots, float *k_cache, float *v_cache, float *q_out,
                int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R) {
    const int64_t kv = KVH * D;
    #pragma omp parallel for schedule(static) if (T > 1)      /* one row: no team to wake */
    for (int64_t t = 0; t < T; t++) {
        const float *row = qk + t * qk_stride, *c = cos_t + t * R, *s = sin_t + t * R;
        for (int64_t head = 0; head < H; head++) rotate(row + head * D, c, s, q_out + (t * H + head) * D, R, D);
        for (int64_t head = 0; head < KVH; head++)
            rotate(row + (H + head) * D, c, s, k_cache + slots[t] * kv + head * D, R, D);
        memcpy(v_cache + slots[t] * kv, v + t * v_stride, sizeof(float) * kv);
    }
}
"""
FLAGS = [*OPTIMIZE, "-ffp-contract=off"]     # no -ffast-math: the torch ops' exact arithmetic


@functools.cache
def load() -> Optional[ctypes.CDLL]:
    """The kernel's library, built on first use; None where it cannot be built."""
    lib = load_library("cpu_exact_rope", SOURCE, FLAGS)
    if lib is not None:
        lib.rope_store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + \
            [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
        lib.rope_store.restype = None
    return lib


def fits(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``rope_store`` takes these: float32 throughout, each row's heads contiguous (a row
    stride of its own is fine: views of the q/k/v projection's output), contiguous pools, and the
    library built."""
    return (qk.dtype == v.dtype == cos.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and qk.dim() == 3 and v.dim() == 3 and qk.stride()[1:] == (qk.shape[2], 1)
            and v.stride()[1:] == (v.shape[2], 1) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and qk.device.type == "cpu" and load() is not None)


def rope_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`qk` `[T, H + KVH, D]` (q heads, then k heads), `v` `[T, KVH, D]` -> q `[T, H, D]` rotated
    (``models.llama.apply_rope`` with `cos`/`sin` `[T, ..., R]`, R <= D rotary dims); k rotated and v
    written into the pools `[blocks, block_size, KVH, D]` at `slots` `[T]` (int64), as
    ``index_copy_kv`` does. Check ``fits`` first."""
    rows, heads, dim = qk.shape
    kv_heads = heads - num_heads
    rotary = cos.shape[-1]
    assert v.shape == (rows, kv_heads, dim) and k_cache.shape[-2:] == (kv_heads, dim) and rotary % 2 == 0
    assert slots.dtype == torch.int64 and slots.shape == (rows,) and rotary <= dim
    cos, sin, slots = cos.reshape(rows, rotary).contiguous(), sin.reshape(rows, rotary).contiguous(), slots.contiguous()
    q = torch.empty(rows, num_heads, dim)
    if rows:
        load().rope_store(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos.data_ptr(), sin.data_ptr(),
                          slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), rows, num_heads,
                          kv_heads, dim, rotary)
    return q

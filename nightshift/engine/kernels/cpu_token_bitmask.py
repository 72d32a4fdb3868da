"""Grammar token masks applied to CPU logits as a small C kernel (kernels/c_library.py builds it).

The sampler's grammar step sets every token a row's bitmask does not allow to -inf (bit
`t % 32` of int32 word `t // 32` allows token t). In torch that is an unpack of every bit
into a [rows, vocab] tensor: 30-80 ms for 256 rows of a 49,152-token vocabulary on a 2-core
AMD EPYC, a tenth of a decode step. The kernel skips the words that allow all 32 tokens
(most of them in the middle of a JSON string), writes -inf for the others' zero bits, and says
per row whether any token is allowed at all: ~1-3 ms. OpenMP over rows. Float32 logits only;
None from `load()` (no compiler, or NIGHTSHIFT_CPU_MASK_KERNEL=0) keeps the torch path.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from nightshift.engine.kernels.c_library import OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* logits [*, ld] float32; rows[n]: the logits row of mask row i; mask [n, words] (uint32 bits);
   tokens at and past `vocab` are left alone; any[i] = 1 if mask row i allows some token. */
void apply_token_bitmask(float *logits, int64_t ld, const int64_t *rows, const uint32_t *mask,
                         int64_t words, int64_t n, int64_t vocab, uint8_t *any) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + rows[i] * ld;
        const uint32_t *m = mask + i * words;
        uint32_t seen = 0;
        for (int64_t w = 0; w < words; w++) {
            const int64_t base = w * 32;
            if (base >= vocab) break;
            const int64_t count = vocab - base < 32 ? vocab - base : 32;
            uint32_t bits = m[w];
            if (count < 32) bits &= (1u << count) - 1u;
            seen |= bits;
            if (bits == 0xffffffffu) continue;
            if (bits == 0) {
                for (int64_t b = 0; b < count; b++) row[base + b] = -INFINITY;
                continue;
            }
            for (int64_t b = 0; b < count; b++)
                if (!((bits >> b) & 1u)) row[base + b] = -INFINITY;
        }
        any[i] = seen != 0;
    }
}
"""

_lib: Optional[ctypes.CDLL] = None
_loaded = False


def load() -> Optional[ctypes.CDLL]:
    global _lib, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("NIGHTSHIFT_CPU_MASK_KERNEL", "1") != "0":
            _lib = load_library("token_bitmask", SOURCE, OPTIMIZE)
        if _lib is not None:
            _lib.apply_token_bitmask.restype = None
            _lib.apply_token_bitmask.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return _lib


def supports(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and load() is not None)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place on `logits` (CPU float32 [batch, vocab], rows contiguous); `rows` int64 [n] on the
    CPU, `bitmask` int32 [n, words]. Returns bool [n]: whether each mask row allows any token."""
    assert rows.dtype == torch.int64 and bitmask.dtype == torch.int32
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    allowed_any = torch.zeros(rows.shape[0], dtype=torch.uint8)
    load().apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), bitmask.data_ptr(),
                               bitmask.shape[1], rows.shape[0], logits.shape[1], allowed_any.data_ptr())
    return allowed_any.bool()

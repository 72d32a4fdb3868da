"""Float32 linear layers on CPU through oneDNN, with the weight packed once at load time.

`F.linear` hands the weight to MKL's sgemm, which re-packs it into its blocked panel layout on
every call. oneDNN can take the weight already in that layout (`mkldnn._reorder_linear_weight`,
the same pre-packing torch.compile's CPU "freezing" pass applies). On the dev machine (AMD EPYC,
2 cores, AVX2), `python -m bench.runner --batch 1 16 256`, alternated with
NIGHTSHIFT_CPU_GEMM=0: a 1-row decode step of the default model 48 -> 38 ms, a 16-row step
115 -> 80 ms, a 256-row step unchanged within noise (~700-790 ms either way), a 256-token prefill
chunk 564-598 -> 494-547 ms; the 49152-wide LM head at one row 8.9 -> 4.4 ms.

The packed tensor is an opaque oneDNN tensor of the same shape; `to_dense()` gives the original
weight back bit for bit. Results agree with `F.linear` to float32 rounding (a different summation
order). Only float32 on CPU is packed: bfloat16 and other devices keep `F.linear`.
NIGHTSHIFT_CPU_GEMM=0 turns packing off (the plain MKL path).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's packed linear and it is not turned off."""
    if os.environ.get("NIGHTSHIFT_CPU_GEMM", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


def applies(weight: torch.Tensor) -> bool:
    """Whether `pack` packs this weight: a 2-D float32 CPU tensor, with oneDNN available."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and available()


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` `[out, in]` in oneDNN's packed layout, or None where it does not apply
    (see `applies`): the caller then keeps the plain weight."""
    if not applies(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for a weight from `pack` (oneDNN) or a plain one (`F.linear`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

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
import time
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
        if x.dim() == 2 and x.shape[0] == 1:
            # oneDNN runs a one-row call through another kernel, which sums a long row (K=1536 here)
            # in another order: the row's last bits would differ from the same row in a larger call,
            # and a lone request's answer from the batched one's. One row goes as two (the cost of a
            # one-row call is reading the weight either way).
            return torch.ops.mkldnn._linear_pointwise(x.repeat(2, 1), weight, bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def packed_is_faster(shapes: tuple[tuple[int, int], ...], rows: int, repeats: int = 3) -> bool:
    """Whether oneDNN with packed weights multiplies ``rows`` rows by float32 weights of these
    ``[out, in]`` shapes faster than ``F.linear`` (MKL) on this machine, measured now (best of
    ``repeats`` per shape, on the calling thread's torch threads; about a quarter second for a
    small encoder). At a few rows packing always pays off (see above); at the thousands of rows
    of an embedding step it depends on the CPU: on the dev box's AVX2 Zen 3 MKL was faster
    (6.43 vs 6.85 s end to end), on an AVX-512 Zen 5, where MKL keeps to its AVX2 kernels on
    AMD, oneDNN runs 2x as fast (196-224 vs 92-98 GFLOP/s per core at 2,048 rows)."""
    if not available():
        return False
    generator = torch.Generator().manual_seed(0)
    plain_total = packed_total = 0.0
    for out_features, in_features in shapes:
        x = torch.randn(rows, in_features, generator=generator)
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        plain_total += best_seconds(lambda: F.linear(x, weight, bias), repeats)
        packed_total += best_seconds(lambda: linear(x, packed, bias), repeats)
    return packed_total < plain_total


def best_seconds(call, repeats: int) -> float:  # noqa: ANN001
    """Fastest of ``repeats`` timed calls of ``call()``, after one untimed warm-up call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best

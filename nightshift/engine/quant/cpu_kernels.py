"""CPU INT4 matmul through torch's own "tinygemm" ops.

``_weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)`` computes
``x @ W.T`` with ``W = (q - 8) * scale + zero``; ``scales_and_zeros`` is ``[K/G, N, 2]`` in the
activation dtype (float32 or bfloat16). Our format stores ``w = q * scale + min``, so
``zero = min + 8 * scale``. The kernel is a dequantize-on-the-fly GEMV per row: it wins over a
dense matmul only for a few rows (see engine/quant/README.md).
"""
from __future__ import annotations

import torch

from nightshift.engine.quant.format import Int4Weight, unpack_int4

TINYGEMM_DTYPES = (torch.float32, torch.bfloat16)


def pack_for_tinygemm(weight: Int4Weight) -> torch.Tensor:
    """Our uint8 [N, K/2] -> the CPU kernel's packed uint8 [N, K/2] (its own nibble order)."""
    q = unpack_int4(weight.qweight).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def tinygemm_scales_and_zeros(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    scales = weight.scales.to(torch.float32)
    zeros = weight.mins.to(torch.float32) + 8 * scales
    return torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()


def tinygemm_linear(x2d: torch.Tensor, packed: torch.Tensor, group_size: int,
                    scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x2d: [M, K] float32/bfloat16 on CPU -> [M, N] in the same dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d.contiguous(), packed, group_size,
                                                      scales_and_zeros)

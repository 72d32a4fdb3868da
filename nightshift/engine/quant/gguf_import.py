"""GGUF Q4_0 / Q4_1 blocks -> our Int4Weight, bit for bit (no dequantize/re-quantize).

ggml blocks (``ggml-common.h``), 32 weights each, one row of the tensor = K/32 blocks:

* ``block_q4_0``: fp16 ``d``, 16 bytes ``qs``; ``w = d * (q - 8)``       -> scale d, min -8d
* ``block_q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes ``qs``; ``w = d*q + m`` -> scale d, min m

In ``qs`` byte ``j`` holds element ``j`` (low nibble) and element ``j + 16`` (high nibble);
our format interleaves (element 2j low, 2j+1 high), so only the nibbles are reshuffled.
Both mappings are exact: ``q*d`` is exact in float32 (11-bit x 4-bit mantissas) and ``-8d``
is a power-of-two multiple, so dequantizing our weight gives GGUF's reference values bitwise.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from nightshift.engine.quant.format import Int4Weight, pack_int4

BLOCK = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
DIRECT_IMPORT_TYPES = frozenset(_BLOCK_BYTES)


def int4_from_gguf_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, out_features: int,
                          in_features: int, name: str = "tensor") -> Int4Weight:
    """``raw``: the tensor's bytes as GGUFReader gives them (uint8, any shape, row-major)."""
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"{name}: GGUF type {qtype.name} cannot be imported directly "
                         f"(only Q4_0/Q4_1); load it through dequantization instead")
    if in_features % BLOCK:
        raise ValueError(f"{name}: row length {in_features} is not a multiple of {BLOCK}")
    block_bytes = _BLOCK_BYTES[qtype]
    n_groups = in_features // BLOCK
    expected = out_features * n_groups * block_bytes
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != expected:
        raise ValueError(f"{name}: {raw.size} bytes of {qtype.name} data, expected {expected} "
                         f"for shape [{out_features}, {in_features}]")
    blocks = torch.from_numpy(raw.copy()).view(out_features, n_groups, block_bytes)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if qtype == GGMLQuantizationType.Q4_1:
        mins = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        qs = blocks[..., 4:]
    else:
        mins = scales * -8
        if not torch.isfinite(mins).all():
            raise ValueError(f"{name}: a Q4_0 scale is too large to express its minimum in float16")
        qs = blocks[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(out_features, in_features)
    return Int4Weight(pack_int4(q), scales.contiguous(), mins.contiguous(), BLOCK)


def int4_from_gguf_tensor(tensor) -> Int4Weight:
    """A ``gguf.GGUFReader`` tensor of type Q4_0/Q4_1 (GGUF lists shapes innermost first)."""
    in_features, out_features = (int(x) for x in tensor.shape[:2])
    return int4_from_gguf_blocks(tensor.data, tensor.tensor_type, out_features, in_features,
                                 name=tensor.name)

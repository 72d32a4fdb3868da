"""The linear-layer seam: the model builds every projection through a `LinearFactory`.

The model is given its factory by whoever builds it (the loader, a benchmark): `DenseLinearFactory`
(full precision: a dense matmul; float32 weights on CPU held once for the model's CPU math,
engine/layers/cpu_math.py), or the INT4 one of engine/quant/linear_factory.py, which receives the
same `WeightSource`; that can hand out the checkpoint's raw GGUF blocks as well as the dense
weight, so GGUF Q4_0/Q4_1 tensors import without re-quantizing. Nothing here knows about INT4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.layers import cpu_math


@dataclass
class GGUFBlocks:
    """One part's raw GGUF data: uint8 rows `[out_features, row_bytes]` (rows in HF order)."""
    raw: np.ndarray
    qtype: int                       # gguf.GGMLQuantizationType value
    out_features: int
    in_features: int


@dataclass
class WeightSource:
    """Where a (possibly fused) projection's weights come from.

    name: the layer name, e.g. "model.layers.3.self_attn.qkv_proj" (a fused q/k/v projection);
    parts: the checkpoint names of the row blocks stacked along the output dim, in order, e.g.
        ["model.layers.3.self_attn.q_proj", ".k_proj", ".v_proj"] (full names, no ".weight").
    tensor: loads a checkpoint tensor by full name (".weight"/".bias"), float32 or the stored dtype;
    gguf: loads a part's raw GGUF blocks (None when the checkpoint is not a quantized GGUF).
    """
    name: str
    parts: list[str]
    tensor: Callable[[str], Optional[torch.Tensor]]
    gguf: Callable[[str], Optional[GGUFBlocks]]
    dtype: torch.dtype
    device: torch.device

    def weight(self) -> torch.Tensor:
        """The dense weight `[sum(out_features), in_features]` in `dtype` on `device`."""
        pieces = [self.tensor(f"{part}.weight") for part in self.parts]
        return torch.cat(pieces, dim=0).to(device=self.device, dtype=self.dtype) if len(pieces) > 1 \
            else pieces[0].to(device=self.device, dtype=self.dtype)

    def bias(self) -> Optional[torch.Tensor]:
        pieces = [self.tensor(f"{part}.bias") for part in self.parts]
        if all(p is None for p in pieces):
            return None
        if any(p is None for p in pieces):
            raise ValueError(f"{self.name}: some fused parts have a bias and some do not")
        return torch.cat(pieces, dim=0).to(device=self.device, dtype=self.dtype)

    def gguf_blocks(self) -> Optional[list[GGUFBlocks]]:
        """Each part's raw GGUF blocks, or None unless every part is a quantized GGUF tensor."""
        blocks = [self.gguf(part + ".weight") for part in self.parts]
        return None if any(b is None for b in blocks) else blocks


class DenseLinear(nn.Module):
    """`x @ W.T (+ b)`. A float32 weight on CPU is held for the model's CPU math
    (engine/layers/cpu_math.py: packed float32 for oneDNN, bf16 or int8) in `packed`, outside the
    state dict, unless `pack` is False (then, as for other dtypes and devices, `F.linear` on the
    plain weight); `weight` gives a float32 copy of a held weight on demand (for inspection, not
    the hot path)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], pack: bool = True,
                 math: str = "float32"):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed = cpu_math.prepare(weight, math) if pack and cpu_math.applies(weight, math) else None
        self.dense = None if self.packed is not None else nn.Parameter(weight, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def math(self) -> Optional[str]:
        """The CPU math the layer runs (None: `F.linear` in the weight's dtype)."""
        return None if self.packed is None else self.packed.math

    @property
    def weight(self) -> torch.Tensor:
        return self.dense if self.packed is None else self.packed.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.dense, self.bias)
        return self.packed.linear(x, self.bias)


class LinearFactory(Protocol):
    """Builds the module of each projection of the model."""

    math: str          # the CPU math of its float32 layers (engine/layers/cpu_math.py)
    # steps of at most this many rows run its layers on a kernel of their own that reads the
    # weights (an INT4 model's small steps on CPU: quant/int4_linear.py), where the LM head reads a
    # GGUF's Q8_0 blocks too (layers/q8_head.py); 0: every step on the same math
    small_step_rows: int
    # its INT4 layers quantize their activations to int8 on every step (the W4A8 kernel:
    # quant/cpu_w4a8.py), where the LM head from a GGUF's Q8_0 blocks does too (layers/q8_head.py)
    int8_activations: bool

    def __call__(self, source: WeightSource) -> nn.Module:
        """A module computing `x @ W.T (+ b)` for the projection `source` describes."""

    def is_dense(self, layer_name: str) -> bool:
        """Whether the layer of this name would be a full-precision DenseLinear (the model then
        may reuse the token embedding as a tied LM head instead of building one)."""


class DenseLinearFactory:
    """Every projection full precision, float32 CPU weights held for `math` (engine/layers/cpu_math.py)."""

    small_step_rows = 0
    int8_activations = False

    def __init__(self, math: str = "float32", head: Optional[str] = None):
        self.math = math
        self.head = head        # the LM head's form on the CPU math, if asked for (cpu_math.choose_head)

    def __call__(self, source: WeightSource) -> DenseLinear:
        return DenseLinear(source.weight(), source.bias(), math=self.math)

    def is_dense(self, layer_name: str) -> bool:
        return True

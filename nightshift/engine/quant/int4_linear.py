"""``Int4Linear``: a linear layer whose weight is stored in our INT4 format.

What runs, chosen per call by ``Int4Linear.kernel_for`` (engine/quant/README.md has the measurements):
* CUDA: the Triton kernels of engine/quant/triton_int4.py on the packed weight (a GEMV, tensor-core
  tiles, or a dequantization pass + cuBLAS) or torch's CUDA int4 kernel, the fastest measured per
  shape and step size (engine/quant/int4_dispatch.py).
* CPU with ``cpu_kernel="w4a8"`` (only when asked for: engine/layers/cpu_math.py ``choose_int4``):
  every step through engine/quant/cpu_w4a8.py, the 4-bit weight (repacked on first use) against
  int8 activations; no dense copy of the weight is kept.
* CPU (``cpu_kernel="dense"``), steps of at most ``cpu_int4_max_rows`` rows: a kernel that reads
  the 4-bit weight, with bfloat16 activations (the result cast back): ours
  (engine/quant/cpu_w4_bf16.py: AVX-512 BF16's ``vdpbf16ps`` on the exact 4-bit values, or on AVX2
  ``vpmaddwd`` against int16 activations) where the CPU has either, else torch's int4 CPU kernel
  (tinygemm; its float32 mode is ~6x slower).
* CPU (``dense``), larger steps: a dense matmul with the dequantized weight in the activation dtype
  (float32 for bfloat16 activations on CPUs without native bf16), kept after first use when
  ``cache_dense_weight`` (else dequantized per call); a kept float32 weight is held for the
  model's CPU math (engine/layers/cpu_math.py: packed float32, bf16 or int8), like the
  full-precision layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.cpu_features import cpu_has_native_bf16
from nightshift.engine.layers import cpu_math
from nightshift.engine.layers.cpu_math import INT4_KERNELS
from nightshift.engine.quant import cpu_w4_bf16, cpu_w4a8
from nightshift.engine.quant.config import DEFAULT_CPU_INT4_MAX_ROWS
from nightshift.engine.quant.cpu_kernels import pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from nightshift.engine.quant.format import Int4Weight


def dense_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Without AMX a bfloat16 CPU matmul is slower than float32 (5.5x at 64 rows on the AVX2 dev
    machine, 1.7x with avx512_bf16; engine/cpu_features.py), so the large-step path computes in
    float32 there."""
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return torch.float32
    return dtype


class Int4Linear(nn.Module):
    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None, *,
                 cpu_int4_max_rows: int = DEFAULT_CPU_INT4_MAX_ROWS,
                 cache_dense_weight: bool = True, cpu_math: str = "float32", cpu_kernel: str = "dense"):
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.group_size = weight.group_size
        self.cpu_int4_max_rows = cpu_int4_max_rows
        self.cache_dense_weight = cache_dense_weight
        self.cpu_math = cpu_math
        if cpu_kernel not in INT4_KERNELS:
            raise ValueError(f"cpu_kernel must be one of {INT4_KERNELS}, got {cpu_kernel!r}")
        self.cpu_kernel = cpu_kernel
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.register_buffer("bias", bias)
        # AWQ-style activation multiplier [K] (None: plain weights), see engine/quant/awq.py
        self.register_buffer("input_scale", None)
        # Kernel-specific forms of the same weight, built on first use per (device, dtype);
        # not part of the state dict (the INT4 format is what is stored and moved).
        self._tinygemm_packed: torch.Tensor | None = None
        self._tinygemm_sz: dict[torch.dtype, torch.Tensor] = {}
        self._dense: dict[tuple[torch.device, torch.dtype], object] = {}
        self._kernel_weight = None        # CUDA: int4_dispatch.KernelWeight (with tinygemm's form, if used)
        self._w4a8: cpu_w4a8.W4A8Weight | None = None
        self._w4_bf16: cpu_w4_bf16.W4Bf16Weight | None = None

    @property
    def int4_weight(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.mins, self.group_size)

    def _apply(self, fn, recurse=True):
        # A move/cast of the module invalidates the derived kernel forms.
        self._tinygemm_packed = None
        self._tinygemm_sz = {}
        self._dense = {}
        self._kernel_weight = None
        self._w4a8 = None
        self._w4_bf16 = None
        return super()._apply(fn, recurse)

    def set_weight(self, weight: Int4Weight, input_scale: torch.Tensor | None = None) -> None:
        """Replace the INT4 weight (same shape), optionally with an activation multiplier."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {weight.shape} != {(self.out_features, self.in_features)}")
        self.group_size = weight.group_size
        self.qweight, self.scales, self.mins = weight.qweight, weight.scales, weight.mins
        self.input_scale = input_scale
        self._apply(lambda t: t)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")

    def kernel_for(self, x2d: torch.Tensor) -> str:
        """The matmul this call runs, by device, CPU kernel and step rows (the module docstring says
        why): "triton" on CUDA, "w4a8" on CPU with that kernel, else for CPU steps of at most
        cpu_int4_max_rows rows "w4-bf16" (ours, where the CPU has AVX-512 BF16 or AVX2) or "tinygemm", and
        "dense" above."""
        if x2d.is_cuda:
            return "triton"
        if self.cpu_kernel == "w4a8":
            return "w4a8"
        if x2d.shape[0] > self.cpu_int4_max_rows:
            return "dense"
        return "w4-bf16" if cpu_w4_bf16.available() else "tinygemm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x2d = x2d * self.input_scale.to(x2d.dtype)
        kernel = self.kernel_for(x2d)
        if kernel == "w4a8":     # float32 or bfloat16 in and out, the bias added in the kernel
            return self._w4a8_weight().linear(x2d, self.bias).reshape(*lead, self.out_features)
        if kernel == "dense":   # the bias goes into the matmul, in its compute dtype
            dtype = dense_compute_dtype(x.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return self._dense_linear(x2d.to(dtype), bias).to(x.dtype).reshape(*lead, self.out_features)
        if kernel == "triton":
            from nightshift.engine.quant.int4_dispatch import KernelWeight, int4_matmul   # imports triton: CUDA only
            if self._kernel_weight is None:
                self._kernel_weight = KernelWeight(self.qweight, self.scales, self.mins, self.group_size)
            y = int4_matmul(x2d, self._kernel_weight)
        else:
            y = self._small_step(x2d.to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def bf16_ready(self) -> bool:
        """Whether ``linear_bf16`` runs here (models/fused_cpu_layer.py takes the layer then): a CPU
        layer with no AWQ input scale, on the W4A8 kernel (whatever the CPU math: it takes and gives
        bfloat16 on any AVX2 CPU, and its int8 activations round far more than bfloat16 does), or on
        the bf16 math (engine/layers/cpu_math.py) with its dense weight kept."""
        if self.qweight.device.type != "cpu" or self.input_scale is not None:
            return False
        return self.cpu_kernel == "w4a8" or (self.cpu_math == "bf16" and self.cache_dense_weight)

    def linear_bf16(self, x2d: torch.Tensor) -> torch.Tensor:
        """bfloat16 ``[M, K]`` -> bfloat16 ``[M, N]``, bias not added (the fused CPU layer adds the
        q/k/v bias itself), on a ``bf16_ready`` layer: the small-step kernel for steps of at most
        ``cpu_int4_max_rows`` rows (bfloat16 in and out, as ``forward`` runs it), else the kept
        dense weight's bf16 matmul (the ``cpu_math.Bf16Weight`` that ``forward``'s dense path uses);
        every step on the W4A8 kernel where that is the layer's CPU kernel."""
        if self.cpu_kernel == "w4a8":
            return self._w4a8_weight().linear(x2d)
        if x2d.shape[0] <= self.cpu_int4_max_rows:
            return self._small_step(x2d)
        w = self._dense_weight(x2d.device, torch.float32)
        if not isinstance(w, cpu_math.Bf16Weight):
            raise RuntimeError(f"linear_bf16 needs the bf16 CPU math's weight, this layer keeps {type(w).__name__}")
        return w.linear_bf16(x2d)

    def _w4a8_weight(self) -> cpu_w4a8.W4A8Weight:
        if self._w4a8 is None:
            self._w4a8 = cpu_w4a8.W4A8Weight(self.int4_weight)
        return self._w4a8

    def _small_step(self, x2d: torch.Tensor) -> torch.Tensor:
        """bfloat16 rows -> bfloat16: our kernel where the CPU has AVX-512 BF16 or AVX2, else torch's."""
        if cpu_w4_bf16.available():
            return self.small_step_weight().linear(x2d)
        return self._tinygemm(x2d)

    def small_steps_on_w4_bf16(self) -> bool:
        """Whether this layer's small steps run on our W4 x bfloat16 kernel: a CPU layer on the dense
        kernel with no AWQ input scale, and a CPU with AVX-512 BF16 or AVX2 (models/fused_cpu_stack.py
        calls that kernel itself then)."""
        return (self.qweight.device.type == "cpu" and self.cpu_kernel == "dense" and self.input_scale is None
                and cpu_w4_bf16.available())

    def small_step_weight(self) -> cpu_w4_bf16.W4Bf16Weight:
        """The weight as our W4 x bfloat16 kernel reads it, built on first use (and again after a
        move, a cast or a new weight)."""
        if self._w4_bf16 is None:
            self._w4_bf16 = cpu_w4_bf16.W4Bf16Weight(self.int4_weight)
        return self._w4_bf16

    def _tinygemm(self, x2d: torch.Tensor) -> torch.Tensor:
        if self._tinygemm_packed is None:
            self._tinygemm_packed = pack_for_tinygemm(self.int4_weight)
        sz = self._tinygemm_sz.get(x2d.dtype)
        if sz is None:
            sz = self._tinygemm_sz[x2d.dtype] = tinygemm_scales_and_zeros(self.int4_weight, x2d.dtype)
        return tinygemm_linear(x2d, self._tinygemm_packed, self.group_size, sz)

    def _dense_weight(self, device: torch.device, dtype: torch.dtype):
        """The dequantized weight in dtype, or the CPU math's form of it (float32 on CPU), kept
        after the first call when cache_dense_weight."""
        key = (device, dtype)
        w = self._dense.get(key)
        if w is None:
            w = self.int4_weight.dequantize(dtype)
            if self.cache_dense_weight:
                if cpu_math.applies(w, self.cpu_math):
                    w = cpu_math.prepare(w, self.cpu_math)
                self._dense[key] = w
        return w

    def _dense_linear(self, x2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2d @ dequantized W.T; when cached, a float32 CPU weight is held for the model's CPU
        math (engine/layers/cpu_math.py) as the full-precision layers' are."""
        w = self._dense_weight(x2d.device, x2d.dtype)
        if isinstance(w, cpu_math.MathWeight):
            return w.linear(x2d, bias)
        return F.linear(x2d, w, bias)

"""Int4LinearFactory: the model's LinearFactory (engine/layers/linear.py) for ``quantization="int4"``.

Each projection the QuantConfig quantizes becomes an Int4Linear: its weight from the quantized-
weight cache when there, else imported from GGUF Q4_0/Q4_1 blocks as they are, or quantized
from the float32 values by the config's method (and stored in the cache). The calibrated methods
(awq, gptq, awq-gptq) need per-layer activation statistics: ``calibrate`` computes them, called
at most once and only when some layer actually has to be quantized (never when every layer is
cached), since it builds and runs the full-precision model. Every other projection stays dense.
The loader builds this factory with both (engine/loader.py); without a cache every layer is
quantized anew.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from gguf import GGMLQuantizationType
from torch import nn

from nightshift.engine.layers.linear import DenseLinear, WeightSource
from nightshift.engine.quant.awq import quantize_awq
from nightshift.engine.quant.cache import QuantizedCheckpointCache
from nightshift.engine.quant.activation_stats import ActivationStats
from nightshift.engine.quant.config import QuantConfig
from nightshift.engine.quant.format import Int4Weight, fitting_group_size, quantize_rtn
from nightshift.engine.quant.gguf_import import DIRECT_IMPORT_TYPES, int4_from_gguf_blocks
from nightshift.engine.quant.gptq import quantize_awq_gptq, quantize_gptq
from nightshift.engine.quant.int4_linear import Int4Linear

Calibrate = Callable[[], dict[str, ActivationStats]]


def int4_weight_for(source: WeightSource, config: QuantConfig,
                    activation_stats: Optional[dict[str, ActivationStats]] = None
                    ) -> tuple[Int4Weight, Optional[torch.Tensor]]:
    """(INT4 weight, AWQ input scale or None) of a (possibly fused) projection: GGUF Q4_0/Q4_1
    blocks imported as they are, anything else quantized from its float32 values (RTN, AWQ,
    GPTQ or both)."""
    blocks = source.gguf_blocks() if config.import_gguf_blocks else None
    if blocks is not None and all(GGMLQuantizationType(b.qtype) in DIRECT_IMPORT_TYPES for b in blocks):
        parts = [int4_from_gguf_blocks(b.raw, GGMLQuantizationType(b.qtype), b.out_features,
                                       b.in_features, name=part)
                 for b, part in zip(blocks, source.parts)]
        return Int4Weight.cat_rows(parts), None
    dense = torch.cat([source.tensor(f"{part}.weight").to(torch.float32) for part in source.parts])
    group = fitting_group_size(dense.shape[1], config.group_size)
    if config.needs_calibration:
        if activation_stats is None or source.name not in activation_stats:
            raise ValueError(f"{source.name}: method={config.method!r} but no calibration activations "
                             f"for this layer")
        if config.method == "gptq":
            return quantize_gptq(dense, activation_stats[source.name], group), None
        if config.method == "awq-gptq":
            return quantize_awq_gptq(dense, activation_stats[source.name], group)
        weight, input_scale, _ = quantize_awq(dense, activation_stats[source.name], group)
        return weight, input_scale
    return quantize_rtn(dense, group), None


class Int4LinearFactory:
    def __init__(self, config: QuantConfig, cache: Optional[QuantizedCheckpointCache] = None,
                 calibrate: Optional[Calibrate] = None, math: str = "float32", cpu_kernel: str = "dense"):
        self.config = config
        self.math = math
        self.cpu_kernel = cpu_kernel          # the INT4 layers' CPU kernel (cpu_math.choose_int4)
        # torch's int4 kernel for steps of up to cpu_int4_max_rows rows (dense); W4A8 runs every step
        self.small_step_rows = config.cpu_int4_max_rows if cpu_kernel == "dense" else 0
        self.int8_activations = cpu_kernel == "w4a8"
        self.cache = cache
        self._calibrate = calibrate
        self._stats: Optional[dict[str, ActivationStats]] = None

    def is_dense(self, layer_name: str) -> bool:
        return not self.config.quantizes(layer_name)

    def __call__(self, source: WeightSource) -> nn.Module:
        if self.is_dense(source.name):
            return DenseLinear(source.weight(), source.bias(), math=self.math)
        cached = self.cache.get(source.name) if self.cache is not None else None
        if cached is not None:
            weight, input_scale = cached
        else:
            stats = self.activation_stats() if self.config.needs_calibration else None
            weight, input_scale = int4_weight_for(source, self.config, stats)
            if self.cache is not None:
                self.cache.put(source.name, weight, input_scale)
        device = torch.device(source.device)
        bias = source.bias()
        layer = Int4Linear(weight.to(device), None if bias is None else bias.to(device),
                           cpu_int4_max_rows=self.config.cpu_int4_max_rows,
                           cache_dense_weight=self.config.cache_dense_weight, cpu_math=self.math,
                           cpu_kernel=self.cpu_kernel)
        if input_scale is not None:
            layer.input_scale = input_scale.to(device)
        return layer

    def activation_stats(self) -> dict[str, ActivationStats]:
        """The calibration statistics, computed on first use."""
        if self._stats is None:
            if self._calibrate is None:
                raise ValueError(f"method={self.config.method!r} needs calibration activations: load the model "
                                 "through nightshift.engine.loader.load_model (or give the factory `calibrate`)")
            self._stats = self._calibrate()
        return self._stats

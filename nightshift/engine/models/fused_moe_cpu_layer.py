"""The mixture-of-experts decoder layer (models/moe.py: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE) as
the fused bf16 CPU kernels run it (models/fused_cpu_layer.py says why and how), per layer:

    h = add_rms_norm(x)
    q = rope_store(qkv_proj(h)); a = attention(q)      q/k norms (per head, or OLMoE's over the whole
                                                       projection) and OLMoE's clip in rope_store
    h = add_rms_norm(x += o_proj(a))
    weights, experts = router(rms_norm(x))             float32, as the torch layer routes
    x += sum over each token's experts of  weight * down_e(silu_mul(gate_up_e(h)))
         (+ sigmoid(gate . rms_norm(x)) * the shared expert of h: Qwen2-MoE)

The experts run grouped by expert as in the torch layer (SparseMoeBlock.expert_outputs: each
expert in use once, on its contiguous rows), their projections bfloat16 in and out (the bf16 CPU
math's packed weights, or INT4 on the W4A8 kernel), SiLU-and-mul in the C kernel, the weighted sum
of each token's experts in float32 straight into the residual stream (``moe_combine``). Both
forms give the same answers up to float32 summation order and the rounding of the
router's input (the torch layer's float32 norm of x; here the same norm, recomputed in float32
from the updated residual stream).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.models.fused_cpu_layer import FusedCpuLayer, bf16_weight


def _expert_weights(expert, weight: Callable) -> Optional[tuple]:
    pair = (weight(expert.gate_up_proj, False), weight(expert.down_proj, False))
    return None if None in pair else pair


def _run(pair: tuple, rows: torch.Tensor) -> torch.Tensor:
    """One expert (gate_up, down) on its bfloat16 rows -> bfloat16."""
    gate_up, down = pair
    return down.linear_bf16(cpu_fused_ops.silu_mul(gate_up.linear_bf16(rows)))


class FusedMoeCpuLayer(FusedCpuLayer):
    """One MoE decoder layer through the fused kernels (``__call__`` is the layer's forward: the
    residual stream `x` is updated in place and returned)."""

    def __init__(self, layer, qkv, o, experts: list[tuple], shared: Optional[tuple]):
        super().__init__(layer, qkv, o, None, None)
        self.block = layer.mlp                          # the router, top-k and the grouping (SparseMoeBlock)
        self.router_norm = layer.post_attention_layernorm
        self.experts, self.shared = experts, shared

    @classmethod
    def from_layer(cls, layer, weight: Callable = bf16_weight):
        attn, block = layer.self_attn, layer.mlp
        qkv, o = weight(attn.qkv_proj, True), weight(attn.o_proj, False)
        experts = [_expert_weights(e, weight) for e in block.experts]
        shared = None if block.shared_expert is None else _expert_weights(block.shared_expert, weight)
        if qkv is None or o is None or None in experts or (block.shared_expert is not None and shared is None):
            return None
        return cls(layer, qkv, o, experts, shared)

    def __call__(self, x, cos, sin, kv_cache, attention, meta) -> torch.Tensor:
        h = cpu_fused_ops.add_rms_norm(x, None, self.input_norm, self.eps)
        h = cpu_fused_ops.add_rms_norm(x, self.attend(h, cos, sin, kv_cache, attention, meta), self.post_norm,
                                       self.post_eps)
        normed = self.router_norm(x)
        weights, chosen = self.block.route(normed)
        out, order = self.block.expert_outputs(h, chosen, lambda e, rows: _run(self.experts[e], rows))
        if self.shared is not None:
            x += torch.sigmoid(F.linear(normed, self.block.shared_expert_gate)) * _run(self.shared, h).float()
        return cpu_fused_ops.moe_combine(x, out, order, weights)

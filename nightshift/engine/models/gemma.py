"""Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) on the shared decoder.

Their differences from the Llama block:
* RMSNorm computes x * (1 + w), all in float32 (GemmaRMSNorm);
* sandwich norms: the attention and the MLP outputs are normed again before the residual add
  (pre/post attention, pre/post feedforward layernorms: GemmaDecoderLayer);
* GeGLU MLP (tanh-approximated gelu on the gate);
* embeddings scaled by sqrt(hidden_size), rounded to the model dtype as transformers does;
* the config switches the rest: query scale query_pre_attn_scalar ** -0.5, attention and
  final logit soft-capping (Gemma 2), alternating sliding-window / global layers (layer_types),
  the local layers' own RoPE base (Gemma 3, rope_local_base_freq), q/k norms (Gemma 3).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.models import fused_cpu_layer
from nightshift.engine.models.llama import MLP, Architecture, Attention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as transformers' Gemma2RMSNorm / Gemma3RMSNorm: normalise and scale in float32
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaArchitecture(Architecture):
    norm = GemmaRMSNorm
    activation = functools.partial(F.gelu, approximate="tanh")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, projection, tensor, arch=GemmaArchitecture):
        super().__init__()
        prefix = f"model.layers.{layer}"

        def norm(name: str) -> nn.Module:
            return arch.norm(tensor(f"{prefix}.{name}.weight"), config.rms_norm_eps)

        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.self_attn = Attention(config, layer, projection, tensor, arch)
        self.mlp = MLP(config, layer, projection, arch)

    def forward(self, x, cos, sin, kv_cache, attention, meta):
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    arch = GemmaArchitecture
    layer_class = GemmaDecoderLayer

    def fused_cpu_form(self, layer: nn.Module):
        """This module's own layer (Gemma norms, GeGLU, the config's q/k norms, windows and
        soft-capping) runs as models/fused_cpu_layer.FusedGemmaCpuLayer where its projections
        compute bfloat16 (the bf16 CPU math, or INT4 on the W4A8 kernel)."""
        if type(layer) is not GemmaDecoderLayer:
            return None
        attn = layer.self_attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm)
        own = (type(attn) is Attention and type(layer.mlp) is MLP and all(type(n) is GemmaRMSNorm for n in norms)
               and layer.mlp.activation is GemmaArchitecture.activation
               and (attn.q_norm is None or (type(attn.q_norm) is GemmaRMSNorm and type(attn.k_norm) is GemmaRMSNorm)))
        return fused_cpu_layer.FusedGemmaCpuLayer if own else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # as transformers: the float32 scale rounded to the model dtype, then multiplied
        normalizer = torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens) * normalizer.to(self.embed_tokens.device)

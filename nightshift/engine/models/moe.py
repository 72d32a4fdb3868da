"""Mixture-of-experts decoders on the shared decoder: Mixtral (`MixtralForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`), OLMoE (`OlmoeForCausalLM`) and Qwen2-MoE (`Qwen2MoeForCausalLM`).

Their difference from the Llama block is the MLP of (some of) their layers: a router (a
full-precision `[num_experts, hidden]` matrix, never quantized) scores every expert, softmax over
all of them in float32, the top k are kept (renormalised to sum to 1 where the config says so:
Mixtral always, Qwen3-MoE and OLMoE by `norm_topk_prob`), and the token's output is the weighted
sum of those k experts, each a SwiGLU MLP of its own (gate|up fused, down), built by the model's
LinearFactory like every other projection (INT4 quantizes the experts too).

The experts are computed grouped by expert: the step's T * k (token, expert) assignments are
sorted by expert, each expert used by the step runs its two GEMMs once on its contiguous rows,
and the rows are scaled by their router weights and scatter-added back to their tokens. A step
is a few GEMMs per used expert, never a loop over tokens.

Per family:
* Mixtral: the Mistral block; experts under `block_sparse_moe` with w1 (gate) / w3 (up) / w2
  (down), every layer sparse, the window of `sliding_window` (when set) on every layer.
* Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm); experts under `mlp` with gate_proj /
  up_proj / down_proj of `moe_intermediate_size`; dense MLP layers (intermediate_size) where
  `mlp_only_layers` or `decoder_sparse_step` say so (ModelConfig.dense_mlp_layers).
* Qwen2-MoE: Qwen2's attention (q/k/v biases); experts as Qwen3-MoE's (dense layers likewise),
  plus one shared expert every token goes through, a SwiGLU MLP of
  `shared_expert_intermediate_size` under `mlp.shared_expert`, its output scaled by
  sigmoid(x . shared_expert_gate) (a `[1, hidden]` matrix kept full precision like the router)
  and added to the routed experts' sum.
* OLMoE: q/k RMSNorm over the whole q and k projections (weights of num_heads * head_dim and
  num_kv_heads * head_dim), before the heads are split and RoPE; q, k, v clamped to
  [-clip_qkv, clip_qkv] after that where the config sets it.

Layer names (WeightSource.name, the module paths, the INT4 cache keys):
"model.layers.{i}.mlp.experts.{e}.gate_up_proj" / ".down_proj" for every family, and
"model.layers.{i}.mlp.shared_expert.gate_up_proj" / ".down_proj" for Qwen2-MoE's shared expert;
the checkpoint parts keep each family's own names.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models.fused_cpu_layer import FusedCpuLayer
from nightshift.engine.models.fused_moe_cpu_layer import FusedMoeCpuLayer
from nightshift.engine.models.llama import (MLP, Architecture, Attention, DecoderLayer, LlamaForCausalLM, Projection,
                                            RMSNorm)


class MoeArchitecture(Architecture):
    """Where a family's checkpoint keeps its experts: `model.layers.{i}.{moe_prefix}.gate.weight`
    (the router) and `...{moe_prefix}.experts.{e}.{gate|up|down}`."""
    moe_prefix: str = "mlp"
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


class MixtralArchitecture(MoeArchitecture):
    moe_prefix = "block_sparse_moe"
    expert_parts = ("w1", "w3", "w2")


class Expert(nn.Module):
    """One expert: SwiGLU MLP (fused gate|up, down) of the model's LinearFactory."""

    def __init__(self, name: str, parts: list[str], intermediate: int, projection: Projection):
        super().__init__()
        gate, up, down = parts
        self.intermediate = intermediate
        self.gate_up_proj = projection(f"{name}.gate_up_proj", [gate, up])
        self.down_proj = projection(f"{name}.down_proj", [down])

    def forward(self, x: torch.Tensor, activation) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(activation(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection, tensor,
                 arch: type[MoeArchitecture]):
        super().__init__()
        source = f"model.layers.{layer}.{arch.moe_prefix}"
        name = f"model.layers.{layer}.mlp"
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.activation = arch.activation
        # the router stays full precision (not a LinearFactory projection: INT4 never touches it)
        self.gate = nn.Parameter(tensor(f"{source}.gate.weight"), requires_grad=False)
        if self.gate.shape[0] != self.num_experts:
            raise ValueError(f"{source}.gate.weight has {self.gate.shape[0]} experts, the config "
                             f"num_experts {self.num_experts}")
        self.experts = nn.ModuleList(
            Expert(f"{name}.experts.{e}", [f"{source}.experts.{e}.{p}" for p in arch.expert_parts],
                   config.expert_intermediate_size, projection)
            for e in range(self.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:      # Qwen2-MoE
            self.shared_expert = Expert(f"{name}.shared_expert",
                                        [f"{source}.shared_expert.{p}" for p in arch.expert_parts],
                                        config.shared_expert_intermediate_size, projection)
            self.shared_expert_gate = nn.Parameter(tensor(f"{source}.shared_expert_gate.weight"), requires_grad=False)
            if self.shared_expert_gate.shape[0] != 1:
                raise ValueError(f"{source}.shared_expert_gate.weight has {self.shared_expert_gate.shape[0]} "
                                 f"rows; one shared expert (one gate row) is supported")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) `[T, top_k]`: softmax over all experts in float32, the top k,
        renormalised over those k where the config says so."""
        probs = torch.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_expert is not None:
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x, self.activation)
        return out

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (the shared expert aside)."""
        weights, chosen = self.route(x)
        out, order = self.expert_outputs(x, chosen, lambda e, rows: self.experts[e](rows, self.activation))
        out = out * weights.reshape(-1, 1).index_select(0, order)
        return torch.zeros_like(x).index_add_(0, order // self.top_k, out)

    def expert_outputs(self, x: torch.Tensor, chosen: torch.Tensor,
                       run: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert step: the T * k (token, expert) assignments of `chosen` sorted by expert, so
        each expert's rows of `x` are contiguous, and ``run(expert, rows)`` called once per expert in
        use. Returns their outputs in that sorted order (`[T * k, hidden]`) and `order` (sorted
        position -> assignment index token * top_k + slot)."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // self.top_k)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(run(expert, rows[start:start + count]))
                start += count
        return torch.cat(outputs), order


class OlmoeAttention(Attention):
    """OLMoE's q/k RMSNorm over the whole projection (then the heads), and clip_qkv."""

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.clip = config.clip_qkv

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        qk = torch.cat((q, k), dim=-1).view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        return qk, v.reshape(tokens, self.num_kv_heads, self.head_dim)


class MoeDecoderLayer(DecoderLayer):
    def build_attention(self, config, layer, projection, tensor, arch):
        if config.qk_norm and not config.qk_norm_per_head:
            return OlmoeAttention(config, layer, projection, tensor, arch)
        if config.clip_qkv is not None:
            raise ValueError(f"{config.architecture}: clip_qkv is not supported for this architecture")
        return super().build_attention(config, layer, projection, tensor, arch)

    def build_mlp(self, config, layer, projection, tensor, arch):
        if config.is_moe(layer):
            return SparseMoeBlock(config, layer, projection, tensor, arch)
        return super().build_mlp(config, layer, projection, tensor, arch)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE, OLMoE and Qwen2-MoE (experts under `mlp`: gate_proj / up_proj / down_proj)."""
    arch = MoeArchitecture
    layer_class = MoeDecoderLayer

    def fused_cpu_form(self, layer: nn.Module) -> Optional[type]:
        """The fused bf16 CPU form of a layer whose norms and attention are the shared decoder's
        (RMSNorm; q/k norms per head or OLMoE's over the whole projection, its clip; a window
        where the config has one; no soft-capping) and whose MLP uses SiLU: its experts
        as models/fused_moe_cpu_layer.py's FusedMoeCpuLayer, a dense MLP layer (Qwen3-MoE's and
        Qwen2-MoE's mlp_only_layers) as FusedCpuLayer."""
        attn = layer.self_attn
        norms = (type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
                 and (attn.q_norm is None or (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)))
        if not norms or type(attn) not in (Attention, OlmoeAttention) or attn.softcap is not None:
            return None
        if type(layer.mlp) is SparseMoeBlock and layer.mlp.activation is F.silu:
            return FusedMoeCpuLayer
        if type(layer.mlp) is MLP and layer.mlp.activation is F.silu:
            return FusedCpuLayer
        return None


class MixtralForCausalLM(MoeForCausalLM):
    arch = MixtralArchitecture

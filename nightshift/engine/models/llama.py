"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral shapes) in plain torch, over a paged KV cache.
It is also the shared decoder of the other architectures (qwen3.py, gemma.py, phi3.py, moe.py): each
declares its differences on it (a norm, a layer, the checkpoint's fused projections, the RoPE
tables, embedding scale) through the class attributes and hooks of LlamaForCausalLM, and the
config switches the rest (q/k norms, sliding windows, soft-capping, partial rotary).

The forward takes one flat batch of tokens (every sequence's new tokens concatenated), the
attention backend of the step and its metadata, which says which rows belong to which sequence
and where their K/V live (engine/attention/). q/k/v and gate/up are fused projections (one
matmul each), each built by the model's LinearFactory (engine/layers/linear.py): dense unless
the builder passes another one (the loader's INT4 factory).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.attention.base import AttentionBackend, StepMetadata
from nightshift.engine.kv_cache import KVCache
from nightshift.engine.layers import cpu_math
from nightshift.engine.layers.linear import DenseLinear, DenseLinearFactory, LinearFactory, WeightSource
from nightshift.engine.layers.q8_head import Q8Head, stored_as_q8_0
from nightshift.engine.models import fused_cpu_layer, fused_cpu_stack, fused_gpu_layer
from nightshift.engine.model_config import ModelConfig, rope_scaling_type

# builds the projection `name` from the checkpoint parts stacked along its output dim
Projection = Callable[[str, list[str]], nn.Module]


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: normalise in float32, scale in the model dtype
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(config: ModelConfig, freq_divisors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] with the config's RoPE scaling applied."""
    inv_freq = base_inv_freq(config.rope_theta, config.rotary_dim)
    kind = rope_scaling_type(config.rope_scaling)
    if kind == "linear":
        inv_freq = inv_freq / float(config.rope_scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, config.rope_scaling)
    if freq_divisors is not None:  # GGUF llama3 files store the scaling as per-frequency divisors
        inv_freq = inv_freq / freq_divisors.float()
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[len(positions), 2 * len(inv_freq)]` (times `scale`, LongRoPE's attention factor)."""
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, looked up per token.
    `inv_freq` overrides the config's frequencies (Gemma 3's local layers); `tables` gives the
    finished (cos, sin) (Phi-3's LongRoPE)."""

    def __init__(self, config: ModelConfig, freq_divisors: Optional[torch.Tensor] = None,
                 inv_freq: Optional[torch.Tensor] = None,
                 tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        super().__init__()
        if tables is None:
            inv_freq = rope_inv_freq(config, freq_divisors) if inv_freq is None else inv_freq
            tables = rope_table(torch.arange(config.max_position_embeddings), inv_freq)
        self.register_buffer("cos", tables[0], persistent=False)
        self.register_buffer("sin", tables[1], persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head (all of them but for partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Architecture:
    """What a model class declares about its checkpoint and blocks (LlamaForCausalLM's defaults)."""
    norm: type = RMSNorm                    # every RMSNorm of the model (Gemma: x * (1 + w))
    activation: Callable = F.silu           # the MLP's gate activation
    fused_qkv: bool = False                 # the checkpoint stores qkv_proj / gate_up_proj fused (Phi-3)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection, tensor=None,
                 arch: type[Architecture] = Architecture):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)              # None: full causal attention
        self.softcap = config.attn_logit_softcapping
        prefix = f"model.layers.{layer}.self_attn"
        parts = [f"{prefix}.qkv_proj"] if arch.fused_qkv else [f"{prefix}.{p}_proj" for p in "qkv"]
        self.qkv_proj = projection(f"{prefix}.qkv_proj", parts)
        self.o_proj = projection(f"{prefix}.o_proj", [f"{prefix}.o_proj"])
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_norm = self.k_norm = None
        if config.qk_norm:     # per-head RMSNorm of q and k, before RoPE (Qwen3, Gemma 3)
            self.q_norm = arch.norm(tensor(f"{prefix}.q_norm.weight"), config.rms_norm_eps)
            self.k_norm = arch.norm(tensor(f"{prefix}.k_norm.weight"), config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k heads `[T, num_heads + num_kv_heads, head_dim]` (q/k-normed where the
        config says so, before RoPE) and v `[T, num_kv_heads, head_dim]` (a hook: OLMoE's norms)."""
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        return qk, v.view(tokens, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, kv_cache: KVCache, attention: AttentionBackend, meta: StepMetadata):
        tokens = x.shape[0]
        qk, v = self.project(x)
        k_cache, v_cache = kv_cache
        # RoPE and the K/V store in one pass where the backend has one (the CPU kernel's, float32)
        q = attention.rope_store(qk, v, cos, sin, k_cache, v_cache, meta, self.num_heads)
        if q is None:
            # q and k heads rotated in one go (fewer ops per layer; per-op overhead matters on CPU)
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
            attention.store_kv(k_cache, v_cache, k, v, meta)
        else:
            k = v = None        # already in the pool, where the backend reads them
        if self.window is None and self.softcap is None:
            out = attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        else:
            out = attention.forward(q, k, v, k_cache, v_cache, meta, self.scale, window=self.window,
                                    softcap=self.softcap)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection,
                 arch: type[Architecture] = Architecture):
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        self.intermediate = config.intermediate_size
        self.activation = arch.activation
        parts = [f"{prefix}.gate_up_proj"] if arch.fused_qkv else [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = projection(f"{prefix}.gate_up_proj", parts)
        self.down_proj = projection(f"{prefix}.down_proj", [f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; `build_attention` / `build_mlp` are the hooks of the
    architectures with other blocks (moe.py: experts, OLMoE's q/k norms)."""

    def __init__(self, config: ModelConfig, layer: int, projection: Projection, tensor,
                 arch: type[Architecture] = Architecture):
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.input_layernorm = arch.norm(tensor(f"{prefix}.input_layernorm.weight"), config.rms_norm_eps)
        self.post_attention_layernorm = arch.norm(tensor(f"{prefix}.post_attention_layernorm.weight"),
                                                  config.rms_norm_eps)
        self.self_attn = self.build_attention(config, layer, projection, tensor, arch)
        self.mlp = self.build_mlp(config, layer, projection, tensor, arch)

    def build_attention(self, config: ModelConfig, layer: int, projection: Projection, tensor,
                        arch: type[Architecture]) -> nn.Module:
        return Attention(config, layer, projection, tensor, arch)

    def build_mlp(self, config: ModelConfig, layer: int, projection: Projection, tensor,
                  arch: type[Architecture]) -> nn.Module:
        return MLP(config, layer, projection, arch)

    def forward(self, x, cos, sin, kv_cache, attention, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def plain_layer(layer: nn.Module) -> bool:
    """Whether `layer` is this module's own decoder layer with nothing another architecture or
    config changes (RMSNorm, SiLU, no sliding window or soft-capping; q/k norms only as Qwen3's
    per-head RMSNorm): the shape models/fused_cpu_layer.py runs as fused kernels
    (models/fused_gpu_layer.py: without q/k norms)."""
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
        return False
    attn = layer.self_attn
    qk_norms = attn.q_norm is None or (type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm)
    return (type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and layer.mlp.activation is F.silu and qk_norms and attn.window is None and attn.softcap is None)


class LlamaForCausalLM(nn.Module):
    """Built from a checkpoint (see nightshift.engine.loader.Checkpoint): `checkpoint.tensor(name)` gives a
    float tensor by HF name, `checkpoint.gguf(name)` raw GGUF blocks or None. `linear` builds every
    projection (default: full precision).

    Subclasses (other architectures) declare `arch` (norm, activation, fused checkpoint
    projections), `layer_class`, and may override `rotary_embeddings` and `embed`."""

    arch: type[Architecture] = Architecture
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, config: ModelConfig, checkpoint, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", linear: Optional[LinearFactory] = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.cpu_math: Optional[cpu_math.Choice] = None    # how its float32 CPU layers multiply (the loader sets it)
        self.cpu_int4: Optional[cpu_math.Choice] = None    # ... and its INT4 layers (dense or w4a8)
        device = torch.device(device)

        def tensor(name: str) -> torch.Tensor:
            value = checkpoint.tensor(name)
            if value is None:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return value.to(device=device, dtype=dtype)

        linear = linear if linear is not None else DenseLinearFactory()

        def projection(name: str, parts: list[str]) -> nn.Module:
            return linear(WeightSource(name, parts, checkpoint.tensor, checkpoint.gguf, dtype, device))

        self.embed_tokens = nn.Parameter(tensor("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, projection, tensor, self.arch)
                                    for i in range(config.num_layers))
        self.norm = self.arch.norm(tensor("model.norm.weight"), config.rms_norm_eps)
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        # an INT4 model's head from the GGUF's own Q8_0 blocks, where it stores the matrix so (the
        # same values as the float weights, half the bytes of bf16: layers/q8_head.py): the calls of
        # a few rows against float activations, or, where the layers quantize their activations to
        # int8 on every step (the W4A8 kernel), every call against int8 activations (q8_head_int8)
        self.q8_head, self.q8_head_rows, self.q8_head_int8 = None, linear.small_step_rows, linear.int8_activations
        # a full-precision model on the bf16 CPU math: that head on every call where it measures
        # faster than the math's own (cpu_math.choose_head; the GGUF's exact weights, int8 activations)
        self.cpu_head: Optional[cpu_math.Choice] = None
        if (device.type == "cpu" and linear.math == "bf16" and not self.q8_head_rows and not self.q8_head_int8
                and linear.is_dense("lm_head")):
            self.cpu_head = cpu_math.choose_head(linear.math, (config.vocab_size, config.hidden_size),
                                                 stored_as_q8_0(checkpoint.gguf, f"{head}.weight"),
                                                 getattr(linear, "head", None))
            self.q8_head_int8 = self.cpu_head.math == "q8"
        if device.type == "cpu" and (self.q8_head_rows > 0 or self.q8_head_int8) and linear.is_dense("lm_head"):
            self.q8_head = Q8Head.from_checkpoint(checkpoint.gguf, f"{head}.weight", self.q8_head_int8)
        if config.tie_word_embeddings and linear.is_dense("lm_head"):
            # reuse the embedding matrix (no second copy), except where the CPU math holds its own
            # form of it (engine/layers/cpu_math.py; packed float32 alone makes the head up to 2x
            # faster), and none where the Q8_0 head takes every call
            every_call_q8 = self.q8_head is not None and self.q8_head_int8
            self.lm_head = (DenseLinear(self.embed_tokens, None, math=linear.math)
                            if cpu_math.applies(self.embed_tokens, linear.math) and not every_call_q8 else None)
        else:
            self.lm_head = projection("lm_head", [head])
        self.rotary = self.rotary_embeddings(config, checkpoint).to(device)
        # the RoPE table each layer uses: "local" (sliding layers, where the config gives them
        # their own base: Gemma 3) or "global"
        self.layer_rope = ["local" if "local" in self.rotary and config.is_sliding(i) else "global"
                           for i in range(config.num_layers)]
        # the same layers as fused C kernels where the projections compute bfloat16 (the CPU's bf16
        # math, or INT4 on the W4A8 kernel) and the layer shape allows
        # (models/fused_cpu_layer.py); None: the torch layers always
        self.fused_layers = fused_cpu_layer.build(self, self.fused_cpu_form)
        # a small step (batch-1 decode) of an INT4 model through those layers (under the float32
        # CPU math, fused forms of the torch layers that only it runs) in one C call
        # (models/fused_cpu_stack.py); None: the layers one by one from Python
        self.fused_stack = fused_cpu_stack.build(self)
        # on CUDA, the same layers with their small ops as Triton kernels (models/fused_gpu_layer.py)
        self.fused_gpu_layers = fused_gpu_layer.build(self, plain_layer)

    def fused_cpu_form(self, layer: nn.Module) -> Optional[type]:
        """The fused bf16 CPU form of `layer` (models/fused_cpu_layer.py), None where it has none."""
        return fused_cpu_layer.FusedCpuLayer if plain_layer(layer) else None

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the runner's K/V pool holds: bfloat16 under the fused bf16 CPU layers (their kernels
        write and read it; decode attention on CPU is bound by reading the pool, and this halves it),
        else the model's dtype."""
        return torch.bfloat16 if self.fused_layers is not None else self.dtype

    def rotary_embeddings(self, config: ModelConfig, checkpoint) -> nn.ModuleDict:
        """The RoPE tables by name: "global", and "local" where sliding layers have their own base."""
        tables = {"global": RotaryEmbedding(config, checkpoint.tensor("rope_freqs"))}
        if config.rope_local_base_freq is not None:
            tables["local"] = RotaryEmbedding(config, inv_freq=base_inv_freq(config.rope_local_base_freq,
                                                                             config.rotary_dim))
        return nn.ModuleDict(tables)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attention: AttentionBackend, meta: StepMetadata,
                logits_rows: Optional[torch.Tensor] = None, float_logits: bool = True) -> torch.Tensor:
        """input_ids, positions: [T], rows in `meta`'s order. Returns float32 logits for
        `logits_rows` (indices into T), or for every row when None; with `float_logits` False, as
        the head computes them (``project_logits``; bfloat16 on the CPU's bf16 math, or from a
        bfloat16 model)."""
        x = self.embed(input_ids)
        rope = {name: table(positions, self.dtype) for name, table in self.rotary.items()}
        layers = self.layers
        on_cpu_kernels = attention.name == fused_cpu_layer.BACKEND
        if on_cpu_kernels and self.fused_stack is not None and self.fused_stack.runs(x.shape[0]):
            x, layers = self.fused_stack(x, rope, kv_caches, meta), ()      # every layer in one C call
        elif on_cpu_kernels and self.fused_layers is not None:
            layers = self.fused_layers
        elif self.fused_gpu_layers is not None and attention.name == fused_gpu_layer.BACKEND:
            layers = self.fused_gpu_layers
        for layer, kv_cache, which in zip(layers, kv_caches, self.layer_rope):
            x = layer(x, *rope[which], kv_cache, attention, meta)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        logits = self.project_logits(self.norm(x), float_logits)
        return logits.float() if float_logits else logits

    def project_logits(self, hidden: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        """The LM head on final hidden states `[..., hidden_size]` (the tied embedding or lm_head;
        an INT4 model's calls of a few rows, or every call of one on int8 activations, the GGUF's Q8_0
        blocks of it), soft-capped where the config says so (Gemma 2). With `float_logits` False, a
        head on the CPU's bf16 math gives its bfloat16 results as they are: its float32 logits are
        those values widened, so a greedy step's argmax is the same, and the copy to float32 (~2% of
        a `bench.engine` run on a Zen 5) is not made."""
        cap, head = self.config.final_logit_softcapping, self.lm_head
        q8 = self.q8_head is not None and hidden.dim() == 2
        if q8 and self.q8_head_int8:
            logits = self.q8_head.linear_int8(hidden)
        elif q8 and hidden.shape[0] <= self.q8_head_rows:
            logits = self.q8_head.linear(hidden)
        elif (not float_logits and cap is None and type(head) is DenseLinear and head.bias is None
              and isinstance(head.packed, cpu_math.Bf16Weight)):
            return head.packed.linear_bf16(hidden.to(torch.bfloat16))
        else:
            logits = F.linear(hidden, self.embed_tokens) if head is None else head(hidden)
        return logits if cap is None else torch.tanh(logits / cap) * cap

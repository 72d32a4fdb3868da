"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral shapes) in plain torch, over a paged KV cache.

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


def rope_inv_freq(config: ModelConfig, freq_divisors: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] with the config's RoPE scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, looked up per token."""

    def __init__(self, config: ModelConfig, freq_divisors: Optional[torch.Tensor] = None):
        super().__init__()
        inv_freq = rope_inv_freq(config, freq_divisors)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim ** -0.5
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = projection(f"{prefix}.qkv_proj", [f"{prefix}.{p}_proj" for p in "qkv"])
        self.o_proj = projection(f"{prefix}.o_proj", [f"{prefix}.o_proj"])
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(self, x, cos, sin, kv_cache: KVCache, attention: AttentionBackend, meta: StepMetadata):
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotated in one go (fewer ops per layer; per-op overhead matters on CPU)
        qk = apply_rope(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        attention.store_kv(k_cache, v_cache, k, v, meta)
        out = attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection):
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        self.intermediate = config.intermediate_size
        self.gate_up_proj = projection(f"{prefix}.gate_up_proj", [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = projection(f"{prefix}.down_proj", [f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, projection: Projection, tensor):
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.input_layernorm = RMSNorm(tensor(f"{prefix}.input_layernorm.weight"), config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(tensor(f"{prefix}.post_attention_layernorm.weight"),
                                                config.rms_norm_eps)
        self.self_attn = Attention(config, layer, projection)
        self.mlp = MLP(config, layer, projection)

    def forward(self, x, cos, sin, kv_cache, attention, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Built from a checkpoint (see nightshift.engine.loader.Checkpoint): `checkpoint.tensor(name)` gives a
    float tensor by HF name, `checkpoint.gguf(name)` raw GGUF blocks or None. `linear` builds every
    projection (default: full precision)."""

    def __init__(self, config: ModelConfig, checkpoint, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", linear: Optional[LinearFactory] = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.cpu_math: Optional[cpu_math.Choice] = None    # how its float32 CPU layers multiply (the loader sets it)
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
        self.layers = nn.ModuleList(DecoderLayer(config, i, projection, tensor) for i in range(config.num_layers))
        self.norm = RMSNorm(tensor("model.norm.weight"), config.rms_norm_eps)
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        if config.tie_word_embeddings and linear.is_dense("lm_head"):
            # reuse the embedding matrix (no second copy), except where the CPU math holds its own
            # form of it (engine/layers/cpu_math.py; packed float32 alone makes the head up to 2x faster)
            self.lm_head = (DenseLinear(self.embed_tokens, None, math=linear.math)
                            if cpu_math.applies(self.embed_tokens, linear.math) else None)
        else:
            self.lm_head = projection("lm_head", [head])
        freq_divisors = checkpoint.tensor("rope_freqs")
        self.rotary = RotaryEmbedding(config, freq_divisors).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attention: AttentionBackend, meta: StepMetadata,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [T], rows in `meta`'s order. Returns float32 logits for
        `logits_rows` (indices into T), or for every row when None."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions, self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attention, meta)
        if logits_rows is not None:
            x = x.index_select(0, logits_rows)
        return self.project_logits(self.norm(x)).float()

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states `[..., hidden_size]` (the tied embedding or lm_head)."""
        return F.linear(hidden, self.embed_tokens) if self.lm_head is None else self.lm_head(hidden)

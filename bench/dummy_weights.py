"""Randomly initialised weights of a named Llama shape (`--dummy-weights` of the benchmarks).

Throughput does not depend on weight values when EOS is ignored, so sizes the default model
cannot show (1B, 8B) are measured on random weights of the real shapes. Tokens come from the
default tokenizer (its ids are valid in every shape's vocabulary). Weights are generated
tensor by tensor, deterministically from the seed and the tensor name, directly on the target
device; INT4 quantization then runs on them like on a real float checkpoint.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Optional

import torch

from nightshift.engine.engine import Engine
from nightshift.engine.engine_config import resolve_device, resolve_dtype
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import build_model
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.quant.linear_factory import Int4LinearFactory
from nightshift.engine.tokenizer import load_tokenizer

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

DUMMY_SHAPES: dict[str, dict] = {
    # Llama 3.2 1B
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=131072, tie_word_embeddings=True,
                     rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    # Llama 3.1 8B
    "llama-8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=131072, tie_word_embeddings=False,
                     rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    # SmolLM2-135M, the default model (its GGUF is too large to carry to a lent GPU in one call)
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    # a few-MB shape for tests of the dummy path itself
    "llama-tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=49152, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=True),
}


def dummy_config(name: str, max_position_embeddings: Optional[int] = None) -> ModelConfig:
    """The ModelConfig of shape `name`; max_position_embeddings caps the context (smaller RoPE
    tables and KV bound)."""
    if name not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy model shape {name!r}; known: {', '.join(DUMMY_SHAPES)}")
    fields = dict(DUMMY_SHAPES[name])
    if max_position_embeddings is not None:
        fields["max_position_embeddings"] = max_position_embeddings
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, bos_token_id=None, eos_token_ids=[],
                       name=f"dummy-{name}", **fields)


class DummyCheckpoint:
    """The checkpoint interface nightshift.engine.models.build_model reads (`config`, `tensor`, `gguf`,
    `names`), with random tensors instead of a file."""

    def __init__(self, config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu", std: float = 0.02):
        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        self.std = std
        self._shapes = self._tensor_shapes()

    def _tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                              "model.norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i in range(c.num_layers):
            p = f"model.layers.{i}"
            shapes.update({
                f"{p}.input_layernorm.weight": (c.hidden_size,),
                f"{p}.post_attention_layernorm.weight": (c.hidden_size,),
                f"{p}.self_attn.q_proj.weight": (q_size, c.hidden_size),
                f"{p}.self_attn.k_proj.weight": (kv_size, c.hidden_size),
                f"{p}.self_attn.v_proj.weight": (kv_size, c.hidden_size),
                f"{p}.self_attn.o_proj.weight": (c.hidden_size, q_size),
                f"{p}.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                f"{p}.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                f"{p}.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            })
            if c.attention_bias:
                for part, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                    shapes[f"{p}.self_attn.{part}_proj.bias"] = (size,)
        return shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def tensor(self, name: str) -> Optional[torch.Tensor]:
        """float32 on the checkpoint's device; norms are ones, everything else N(0, std^2); the
        same name and seed always give the same values. None for a name the shape lacks."""
        shape = self._shapes.get(name)
        if shape is None:
            return None
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device)
        if self.device.type == "meta":   # shapes only (e.g. to size a model without memory)
            return torch.empty(shape, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=generator, device=self.device) * self.std

    def gguf(self, name: str) -> None:
        return None


def build_dummy_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", quant_config=None,
                      seed: int = 0, max_position_embeddings: Optional[int] = None):
    """Our LlamaForCausalLM with random weights of shape `name` (see DUMMY_SHAPES); with a
    quant_config its layers are INT4, quantized at build time (no disk cache, and no calibration:
    the methods that need one are refused)."""
    checkpoint = DummyCheckpoint(dummy_config(name, max_position_embeddings), seed=seed, device=device)
    linear = None if quant_config is None else Int4LinearFactory(quant_config)
    return build_model(checkpoint, dtype=dtype, device=device, linear=linear)


def dummy_engine(name: str, quantization: str = "none", device: str = "auto", dtype=None, seed: int = 0,
                 max_position_embeddings: Optional[int] = None, tokenizer: str = "default", **engine_options):
    """An Engine over random weights of shape `name`, with the tokenizer of `tokenizer` (a model, or a
    saved tokenizer directory; see load_tokenizer), by default the default model's.
    engine_options: those of Engine.from_model (max_num_seqs, num_kv_blocks, ...)."""
    device = resolve_device(device)
    model = build_dummy_model(name, resolve_dtype(dtype, device), device, resolve_quant_config(quantization),
                              seed, max_position_embeddings)
    return Engine.from_model(model, load_tokenizer(tokenizer), f"dummy-{name}", **engine_options)


def save_hf_folder(name: str, folder: Path, seed: int = 0, tokenizer: str = "default",
                   max_position_embeddings: Optional[int] = None) -> Path:
    """Random weights of shape `name` written as a Hugging Face model folder (config.json,
    model.safetensors, the tokenizer files of `tokenizer`): a model any process can load by path,
    through the same loader as a real checkpoint (NIGHTSHIFT_MODEL=<folder> for the workers)."""
    from safetensors.torch import save_file

    config = dummy_config(name, max_position_embeddings)
    source = load_tokenizer(tokenizer)
    if source.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer!r} has {source.vocab_size} tokens, the {name} shape only "
                         f"{config.vocab_size}")
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = DummyCheckpoint(config, seed=seed)
    save_file({n: checkpoint.tensor(n).contiguous() for n in checkpoint.names()}, str(folder / "model.safetensors"))
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.hidden_size,
                 "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
                 "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
                 "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
                 "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
                 "max_position_embeddings": config.max_position_embeddings,
                 "tie_word_embeddings": config.tie_word_embeddings, "rope_scaling": config.rope_scaling,
                 "eos_token_id": list(source.eos_token_ids)}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=1))
    source.backend.save(str(folder / "tokenizer.json"))
    tokens = {key: value for key, value in source.special_tokens.items() if value is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": source.chat_template, **tokens}))
    return folder

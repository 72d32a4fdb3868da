"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`) on the shared decoder.

Their differences from the Llama block:
* the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (loaded as
  they are: the same fused layers the shared decoder builds from separate parts);
* partial rotary (config.partial_rotary_factor: RoPE on the first dims of each head);
* LongRoPE scaling ("longrope", formerly "su"): per-frequency `short_factor` divisors up to
  `original_max_position_embeddings`, `long_factor` beyond, and cos/sin scaled by the attention
  factor sqrt(1 + ln(factor) / ln(original)) (or the config's `attention_factor`).

LongRoPE switch: position p is rotated with the long factors iff p >= original_max_position_embeddings.
transformers decides per forward call (the long factors for a whole call once it reaches past
the original length); both agree exactly while prompts fit the original length (decode then
switches at the same position), which is how Phi-3 checkpoints are usually run. A prompt longer
than the original length is rotated short-then-long here where transformers would use the long
factors for all of it in one call.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nightshift.engine.model_config import ModelConfig, rope_scaling_type
from nightshift.engine.models.llama import Architecture, LlamaForCausalLM, RotaryEmbedding, rope_table


class Phi3Architecture(Architecture):
    fused_qkv = True


def longrope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[max_position_embeddings, rotary_dim]` of a LongRoPE config."""
    scaling = config.rope_scaling
    original = int(scaling["original_max_position_embeddings"])
    dim = config.rotary_dim
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"rope_scaling.{key} has {ext.numel()} values, rotary_dim / 2 is {dim // 2}")
        # 1 / (ext * theta^(2i/d)), as transformers computes it
        inv_freq = 1.0 / (ext * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        tables.append(inv_freq)
    positions = torch.arange(config.max_position_embeddings)
    short = rope_table(positions[:original], tables[0], attention_factor)
    long = rope_table(positions[original:], tables[1], attention_factor)
    return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))


class Phi3ForCausalLM(LlamaForCausalLM):
    arch = Phi3Architecture

    def rotary_embeddings(self, config: ModelConfig, checkpoint) -> nn.ModuleDict:
        if rope_scaling_type(config.rope_scaling) != "longrope":
            return super().rotary_embeddings(config, checkpoint)
        return nn.ModuleDict({"global": RotaryEmbedding(config, tables=longrope_tables(config))})

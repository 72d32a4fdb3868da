"""Model architectures. Every supported family (Llama, SmolLM, Qwen2, Mistral) is the same
decoder block, so one implementation serves them all."""
from __future__ import annotations

from typing import Optional

import torch

from nightshift.engine.layers.linear import LinearFactory
from nightshift.engine.models.llama import LlamaForCausalLM


def build_model(checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu",
                linear: Optional[LinearFactory] = None) -> LlamaForCausalLM:
    """The model of `checkpoint` in eval mode; `linear` builds its projections (default: dense)."""
    model = LlamaForCausalLM(checkpoint.config, checkpoint, dtype=dtype, device=device, linear=linear)
    return model.eval()


__all__ = ["LlamaForCausalLM", "build_model"]

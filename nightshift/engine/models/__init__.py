"""Model architectures. Every supported family (Llama, SmolLM, Qwen2, Mistral) is the same
decoder block, so one implementation serves them all."""
from __future__ import annotations

import torch

from nightshift.engine.models.llama import LlamaForCausalLM


def build_model(checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu",
                quant_config=None) -> LlamaForCausalLM:
    model = LlamaForCausalLM(checkpoint.config, checkpoint, dtype=dtype, device=device, quant_config=quant_config)
    return model.eval()


__all__ = ["LlamaForCausalLM", "build_model"]

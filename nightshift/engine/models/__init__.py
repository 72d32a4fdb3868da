"""Model architectures: the shared decoder of models/llama.py (Llama, SmolLM, Qwen2, Mistral),
and the architectures that declare their differences on it (qwen3.py, gemma.py, phi3.py; moe.py:
the mixture-of-experts decoders Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE).
`build_model` picks the class by the config's architecture."""
from __future__ import annotations

from typing import Optional

import torch

from nightshift.engine.layers.linear import LinearFactory
from nightshift.engine.models.gemma import GemmaForCausalLM
from nightshift.engine.models.llama import LlamaForCausalLM
from nightshift.engine.models.moe import MixtralForCausalLM, MoeForCausalLM
from nightshift.engine.models.phi3 import Phi3ForCausalLM
from nightshift.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "mistral": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": GemmaForCausalLM, "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM, "qwen3_moe": MoeForCausalLM, "olmoe": MoeForCausalLM,
    "qwen2_moe": MoeForCausalLM,
}


def build_model(checkpoint, dtype: torch.dtype = torch.float32, device: str = "cpu",
                linear: Optional[LinearFactory] = None) -> LlamaForCausalLM:
    """The model of `checkpoint` in eval mode; `linear` builds its projections (default: dense)."""
    architecture = checkpoint.config.architecture
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"no model class for architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}")
    model = MODEL_CLASSES[architecture](checkpoint.config, checkpoint, dtype=dtype, device=device, linear=linear)
    return model.eval()


__all__ = ["GemmaForCausalLM", "LlamaForCausalLM", "MODEL_CLASSES", "MixtralForCausalLM", "MoeForCausalLM",
           "Phi3ForCausalLM", "Qwen3ForCausalLM", "build_model"]

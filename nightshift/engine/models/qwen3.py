"""Qwen3 (`Qwen3ForCausalLM`): the Llama block with an RMSNorm over each q and k head before
RoPE (`q_norm` / `k_norm`, weights of size head_dim), no q/k/v biases by default, and a
head_dim of its own (config.head_dim, not hidden_size / heads). The q/k norms are switched on
by the config (ModelConfig.qk_norm), so the class only names the architecture."""
from __future__ import annotations

from nightshift.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

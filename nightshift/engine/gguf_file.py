"""Reading a GGUF file: metadata, tensors under Hugging Face names, llama.cpp's Q/K permutation undone.

llama.cpp's converter permutes the rows of attn_q / attn_k of Llama-architecture models (so its
RoPE can rotate adjacent pairs); `unpermute_qk_rows` restores the Hugging Face row order. Rows
are independent in every GGUF quantization format (blocks run along a row), so the same row
permutation applies to the raw quantized bytes, which the INT4 path imports without re-quantizing.

Each GGUF architecture's tensor names are declared in LAYER_NAMES (the same llama.cpp name can be
another HF tensor: Gemma's ffn_norm is its pre-feedforward norm, Phi-3's ffn_up its fused gate|up).
Gemma's norm weights, stored as 1 + w, are given back as w; Phi-3's LongRoPE factor tensors are
config values (CONFIG_TENSORS), read by ModelConfig.from_gguf_metadata, not weights. A mixture of
experts' stacked expert tensors (ffn_*_exps, `[experts, out, in]`) are given back one per expert.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# llama.cpp's tensor names -> Hugging Face names, per GGUF architecture (blk.N.<key> -> model.layers.N.<value>)
_PROJECTIONS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **_PROJECTIONS,
    "attn_q.bias": "self_attn.q_proj.bias",          # Qwen2's q/k/v biases
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight",      # per-head q/k RMSNorms (Qwen3, Gemma 3)
             "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma's sandwich norms: ffn_norm is the pre-feedforward norm, post_attention_norm / post_ffw_norm
# norm the attention and MLP outputs
_GEMMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **_PROJECTIONS,
}
# Phi-3 keeps its fused checkpoint tensors: attn_qkv (q|k|v rows) and ffn_up (gate|up rows)
_PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _experts(prefix: str, parts: tuple[str, str, str]) -> dict[str, str]:
    """A mixture of experts' router (ffn_gate_inp) and its experts, stacked `[experts, out, in]` in
    ffn_{gate,up,down}_exps: "{e}" in the HF name marks a stacked tensor, given back one per expert
    as the HF checkpoints of the family (models/moe.py) name them."""
    gate, up, down = parts
    return {"ffn_gate_inp.weight": f"{prefix}.gate.weight",
            "ffn_gate_exps.weight": f"{prefix}.experts.{{e}}.{gate}.weight",
            "ffn_up_exps.weight": f"{prefix}.experts.{{e}}.{up}.weight",
            "ffn_down_exps.weight": f"{prefix}.experts.{{e}}.{down}.weight"}


_MLP_EXPERTS = _experts("mlp", ("gate_proj", "up_proj", "down_proj"))
# Qwen2-MoE's shared expert and its sigmoid gate
_SHARED_EXPERT = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                  "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# "mixtral": llama.cpp writes Mixtral as architecture "llama" with llama.expert_count (GGUFFile.layout)
LAYER_NAMES = {"llama": _LLAMA_LAYER, "qwen2": _LLAMA_LAYER, "mistral": _LLAMA_LAYER,
               "qwen3": {**_LLAMA_LAYER, **_QK_NORMS},
               "gemma2": _GEMMA_LAYER, "gemma3": {**_GEMMA_LAYER, **_QK_NORMS},
               "phi3": _PHI3_LAYER,
               "mixtral": {**_LLAMA_LAYER, **_experts("block_sparse_moe", ("w1", "w3", "w2"))},
               "qwen3moe": {**_LLAMA_LAYER, **_QK_NORMS, **_MLP_EXPERTS},
               "olmoe": {**_LLAMA_LAYER, **_QK_NORMS, **_MLP_EXPERTS},   # its q/k norms span the whole projection
               "qwen2moe": {**_LLAMA_LAYER, **_MLP_EXPERTS, **_SHARED_EXPERT}}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3-style per-frequency RoPE divisors
}
# tensors that are config values, not weights (ModelConfig.from_gguf_metadata reads them): Phi-3's LongRoPE factors
CONFIG_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
# llama.cpp's converter writes Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight);
# our GemmaRMSNorm computes x * (1 + w), as transformers does, so the 1 is taken back off
NORMS_PLUS_ONE = ("gemma2", "gemma3")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Float types that need no block handling; every other type is a quantized block format.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor name in llama.cpp's layout of `architecture`
    (a LAYER_NAMES key; stacked experts' names hold "{e}"); ValueError for unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if architecture not in LAYER_NAMES:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {', '.join(LAYER_NAMES)}")
    match = _BLOCK_RE.match(gguf_name)
    layer_names = LAYER_NAMES[architecture]
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Llama-family mapping in llama.cpp's "
                     f"{architecture!r} layout (GGUF architectures: {', '.join(LAYER_NAMES)})")


def unpermute_qk_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(weights, n_head)` along axis 0 (works on raw quantized rows too)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class GGUFTensor:
    """One tensor under its HF name. `raw` is the file's data (uint8 rows for quantized types,
    a float array for float types), rows already in HF order."""
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]          # HF order: (out_features, in_features) for matrices
    raw: np.ndarray

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    def dequantize(self) -> np.ndarray:
        """float32 values, shaped `shape` (the same arithmetic transformers' GGUF loader uses)."""
        return np.array(dequantize(self.raw, self.qtype), dtype=np.float32).reshape(self.shape)


class GGUFFile:
    """An opened GGUF file (memory-mapped). Opening parses all metadata: seconds for a big vocabulary."""

    def __init__(self, path: str):
        self.path = path
        self.reader = GGUFReader(path)
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self.architecture = self.metadata.get("general.architecture")
        # the LAYER_NAMES key of the file's tensor names: Mixtral is "llama" with experts
        self.layout = ("mixtral" if self.architecture == "llama" and self.metadata.get("llama.expert_count")
                       else self.architecture)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def config_tensors(self) -> dict[str, list[float]]:
        """The CONFIG_TENSORS the file has, as lists of floats under their config keys."""
        return {CONFIG_TENSORS[t.name]: [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
                for t in self.reader.tensors if t.name in CONFIG_TENSORS}

    def tensors(self) -> Iterator[GGUFTensor]:
        """The weights under their HF names (CONFIG_TENSORS left out)."""
        heads = self.metadata.get(f"{self.architecture}.attention.head_count")
        kv_heads = self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads)
        # convert_hf_to_gguf.py permutes Q/K only for its LlamaModel (llama, mistral files say "llama")
        permuted = self.architecture == "llama"
        for tensor in self.reader.tensors:
            if tensor.name in CONFIG_TENSORS:
                continue
            name = hf_name(tensor.name, self.layout)
            shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists the innermost dim first
            qtype, raw = GGMLQuantizationType(tensor.tensor_type), tensor.data
            if "{e}" in name:            # stacked experts: one tensor per expert (rows are whole per expert)
                if len(shape) != 3:
                    raise ValueError(f"GGUF tensor {tensor.name!r} has shape {shape}, not [experts, out, in]")
                for e in range(shape[0]):
                    yield GGUFTensor(name.format(e=e), qtype, shape[1:], raw[e])
                continue
            if name.endswith("shared_expert_gate.weight") and len(shape) == 1:    # as [1, hidden]
                shape, raw = (1, shape[0]), raw.reshape(1, -1)
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                raw = unpermute_qk_rows(raw, heads)
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                raw = unpermute_qk_rows(raw, kv_heads)
            elif self.architecture in NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
                qtype, raw = GGMLQuantizationType.F32, GGUFTensor(name, qtype, shape, raw).dequantize() - 1.0
            yield GGUFTensor(name, qtype, shape, raw)

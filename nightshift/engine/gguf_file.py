"""Reading a GGUF file: metadata, tensors under Hugging Face names, llama.cpp's Q/K permutation undone.

llama.cpp's converter permutes the rows of attn_q / attn_k of Llama-architecture models (so its
RoPE can rotate adjacent pairs); `unpermute_qk_rows` restores the Hugging Face row order. Rows
are independent in every GGUF quantization format (blocks run along a row), so the same row
permutation applies to the raw quantized bytes, which the INT4 path imports without re-quantizing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",     # Qwen3's per-head q/k RMSNorms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3-style per-frequency RoPE divisors
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Float types that need no block handling; every other type is a quantized block format.
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name; ValueError for unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Llama-family mapping (llama, qwen2, mistral, qwen3)")


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

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def tensors(self) -> Iterator[GGUFTensor]:
        heads = self.metadata.get(f"{self.architecture}.attention.head_count")
        kv_heads = self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads)
        # convert_hf_to_gguf.py permutes Q/K only for its LlamaModel (llama, mistral files say "llama")
        permuted = self.architecture == "llama"
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists the innermost dim first
            raw = tensor.data
            if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
                raw = unpermute_qk_rows(raw, heads)
            elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
                raw = unpermute_qk_rows(raw, kv_heads)
            yield GGUFTensor(name, GGMLQuantizationType(tensor.tensor_type), shape, raw)

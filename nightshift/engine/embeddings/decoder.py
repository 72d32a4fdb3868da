"""Decoder-based embedding models (the Qwen3-Embedding shape) on the generation engine's decoders.

A sentence-transformers (or plain Hugging Face) folder whose transformer is a decoder the engine
knows (models/: Llama, Qwen2, Mistral, Qwen3, Gemma 2/3 text, Phi-3) is built with the same
model classes the generation engine runs, and used without its LM head: a step's sequences,
concatenated `[T]` as for BERT (varlen.py), go through the model's own `embed`, its `layers`
(each with its RoPE table, `layer_rope`) and its final `norm`, and the final-norm token states
`[T, H]` are pooled as the folder says (pooling.py: lasttoken, mean, max, ...; "cls", the first
token of a causal model, is refused). Nothing is cached: the layers' attention hook gets
`VarlenCausalAttention`, which ignores the KV-pool arguments and attends causally within each
sequence over the step's own k/v (one SDPA call per run of equal lengths, as varlen.py does).

Checkpoints name the decoder's tensors under "model." (a `Qwen3ForCausalLM`) or bare
("embed_tokens.weight", ...: a `Qwen3Model`, as sentence-transformers saves Qwen3-Embedding);
both load. The LM head is never built (an lm_head tensor, if present, is not read).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from nightshift.engine.attention.base import AttentionBackend
from nightshift.engine.embeddings.pooling import PoolingConfig
from nightshift.engine.embeddings.varlen import VarlenBatch
from nightshift.engine.layers import cpu_gemm
from nightshift.engine.layers.linear import DenseLinear, WeightSource
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import MODEL_CLASSES, LlamaForCausalLM

log = logging.getLogger(__name__)

DECODER_MODEL_TYPES = tuple(MODEL_CLASSES)    # config.json model_type values served by this module
_ANCHOR = "embed_tokens.weight"
_HEAD = "lm_head"
GEMM_PROBE_ROWS = 512


def is_decoder_config(config: dict) -> bool:
    """Whether config.json describes a decoder of models/ (rather than a BERT-family encoder)."""
    return config.get("model_type") in DECODER_MODEL_TYPES


def check_decoder_pooling(pooling: PoolingConfig, path: Path | str = "") -> None:
    """Refuse pooling modes that make no sense on a causal model: "cls" would pool the first
    token, which has seen nothing but itself."""
    if "cls" in pooling.modes:
        raise ValueError(f"embedding model {path}: cls pooling is not supported for a decoder (causal) model; "
                         f"decoder embedding models pool with lasttoken or mean")


@dataclass(frozen=True)
class DecoderEncoderConfig:
    """What the embedding engine reads off its encoder's config, for a decoder."""
    model: ModelConfig

    @property
    def model_type(self) -> str:
        return self.model.architecture

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def max_positions(self) -> int:
        """Longest sequence the RoPE tables hold."""
        return self.model.max_position_embeddings


class EmbeddingCheckpoint:
    """The `checkpoint` interface models/ builds from (tensor by "model."-prefixed HF name, gguf),
    over safetensors files that name the decoder's tensors with any prefix ("model.", or none)."""

    def __init__(self, config: ModelConfig, files: Sequence[Path]):
        self.config = config
        handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in handles for name in h.keys()}
        anchors = [n for n in self._where if n.endswith(_ANCHOR)]
        if not anchors:
            raise KeyError(f"no {_ANCHOR} in {', '.join(str(f) for f in files)}: not a decoder checkpoint")
        self.prefix = min(anchors, key=len)[:-len(_ANCHOR)]    # "model." or "" (a bare Qwen3Model)

    def tensor(self, name: str) -> Optional[torch.Tensor]:
        if name.startswith("model."):
            name = self.prefix + name[len("model."):]
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def gguf(self, name: str) -> None:
        return None


class _NoHead(nn.Module):
    """Stands where the LM head would be: never built, never called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an embedding model has no LM head")


class HeadlessLinearFactory:
    """models/' LinearFactory: dense projections (oneDNN-packed float32 on CPU when `pack`), and
    no LM head at all (is_dense("lm_head") is False, so a tied head is not packed either)."""

    math = "float32"
    small_step_rows = 0
    int8_activations = False

    def __init__(self, pack: bool = False):
        self.pack = pack

    def __call__(self, source: WeightSource) -> nn.Module:
        if source.name == _HEAD:
            return _NoHead()
        return DenseLinear(source.weight(), source.bias(), pack=self.pack, math=self.math)

    def is_dense(self, layer_name: str) -> bool:
        return layer_name != _HEAD


class VarlenCausalAttention(AttentionBackend):
    """The attention hook for a cache-less forward over a VarlenBatch (passed as the model's
    `meta`): `store_kv` keeps nothing, `forward` attends causally within each sequence over the
    step's own k, v. Sliding windows and soft-capping (Gemma) take a masked path."""

    name = "varlen-causal"

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, 1, dtype, torch.device(device))

    def build_metadata(self, items):  # noqa: ANN001, ANN201
        raise NotImplementedError("VarlenCausalAttention runs on a VarlenBatch, not on scheduled items")

    def store_kv(self, k_cache, v_cache, k, v, meta) -> None:  # noqa: ANN001
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache,  # noqa: ANN001
                meta: VarlenBatch, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        """q `[T, H, D]`, k, v `[T, KV, D]` -> `[T, H, D]`."""
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        outs = []
        for start, count, length in meta.groups:
            rows = slice(start, start + count * length)
            qg, kg, vg = (t[rows].view(count, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
            if window is None and softcap is None:
                if heads != kv_heads:
                    kg, vg = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kg, vg))
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
            else:
                out = _masked_attention(qg, kg, vg, scale, window, softcap)
            outs.append(out.transpose(1, 2).reshape(count * length, heads, head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: Optional[int],
                      softcap: Optional[float]) -> torch.Tensor:
    """Causal attention with a sliding window and/or soft-capped scores, in float32:
    q `[B, H, L, D]`, k, v `[B, KV, L, D]`."""
    heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
    if heads != kv_heads:
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(length, device=q.device)
    allowed = pos.unsqueeze(1) >= pos.unsqueeze(0)
    if window is not None:
        allowed &= pos.unsqueeze(1) - pos.unsqueeze(0) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


class DecoderEncoder(nn.Module):
    """A decoder of models/ as the embedding engine's encoder: token ids `[T]` laid out as a
    VarlenBatch -> final-norm hidden states `[T, H]` (no LM head)."""

    def __init__(self, model: LlamaForCausalLM, gemm: str = "F.linear"):
        super().__init__()
        self.model = model
        self.config = DecoderEncoderConfig(model.config)
        self.attention = VarlenCausalAttention(model.config, model.dtype, model.embed_tokens.device)
        self.gemm = gemm

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.dtype

    def forward(self, token_ids: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        """What LlamaForCausalLM.forward computes before its LM head, through the model's public
        parts: `embed`, the `rotary` tables, each of `layers` with its `layer_rope` table, `norm`."""
        model = self.model
        x = model.embed(token_ids)
        rope = {name: table(batch.positions, model.dtype) for name, table in model.rotary.items()}
        no_cache = (None, None)
        for layer, which in zip(model.layers, model.layer_rope):
            x = layer(x, *rope[which], no_cache, self.attention, batch)
        return model.norm(x)


def build_decoder_encoder(config: dict, files: Sequence[Path], dtype: torch.dtype = torch.float32,
                          device: torch.device | str = "cpu", pack_weights: Optional[bool] = None,
                          name: str = "") -> DecoderEncoder:
    """The DecoderEncoder of a decoder's config.json dict and safetensors files. `pack_weights`
    None: the float32 CPU projections run on oneDNN's packed GEMM iff it measures faster on this
    machine for one layer's shapes (as weights.load_encoder decides for BERT)."""
    model_config = ModelConfig.from_hf_config(config, name=name)
    if model_config.architecture not in MODEL_CLASSES:
        raise ValueError(f"embedding model type {model_config.architecture!r} is not a decoder the engine knows "
                         f"(supported: {', '.join(MODEL_CLASSES)})")
    if pack_weights is None:
        layer_shapes = model_config.projection_shapes[:4]
        pack_weights = (dtype == torch.float32 and torch.device(device).type == "cpu"
                        and cpu_gemm.packed_is_faster(layer_shapes, GEMM_PROBE_ROWS))
    checkpoint = EmbeddingCheckpoint(model_config, files)
    model = MODEL_CLASSES[model_config.architecture](model_config, checkpoint, dtype=dtype, device=device,
                                                     linear=HeadlessLinearFactory(pack_weights)).eval()
    packed = bool(model.layers) and getattr(model.layers[0].self_attn.qkv_proj, "packed", None) is not None
    encoder = DecoderEncoder(model, "onednn-packed" if packed else "F.linear")
    log.info("embedding decoder %s GEMMs: %s", model_config.architecture, encoder.gemm)
    return encoder.eval()

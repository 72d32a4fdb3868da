"""The BERT-family encoder (BERT, RoBERTa, XLM-R shapes) in plain torch, padding-free.

The forward takes one step's tokens concatenated `[T]` and a VarlenBatch (varlen.py) and returns
the last layer's token states `[T, H]`; only attention looks at sequence boundaries. Per layer:
fused q/k/v projection -> attention -> output projection + residual -> LayerNorm -> up
projection with the activation -> down projection + residual -> LayerNorm (post-norm, as BERT).

Projections are `F.linear` (MKL's sgemm on CPU) or oneDNN on weights packed once at load
(engine/layers/cpu_gemm.py), whichever `cpu_gemm.packed_is_faster` measures faster on the machine
for the model's shapes (`load_encoder`; `BertEncoder.gemm` says which). At a step's thousands of
rows the GEMMs are compute-bound and the answer depends on the CPU. On the dev box's AVX2 Zen 3
(one thread, 300 texts of bench/embedding_texts.py, best of 5 alternated runs): F.linear 6.43 s,
oneDNN packed 6.85 s, and with GELU and the residual add fused into the oneDNN call 7.53 s. On an
AVX-512 Zen 5, where MKL keeps to its AVX2 kernels on AMD, oneDNN's GEMMs run 2x as fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.embeddings.varlen import VarlenBatch, grouped_attention
from nightshift.engine.layers.linear import DenseLinear

SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}

Attention = Callable[[torch.Tensor, VarlenBatch, int], torch.Tensor]


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    activation: str                  # "gelu" (erf), "gelu_tanh", "relu" or "silu"
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    position_offset: int             # first position id: 0 (BERT), padding_idx + 1 (RoBERTa, XLM-R)

    @property
    def projection_shapes(self) -> tuple[tuple[int, int], ...]:
        """`[out, in]` of each layer's projections: q|k|v, attention output, up, down."""
        h, i = self.hidden_size, self.intermediate_size
        return (3 * h, h), (h, h), (i, h), (h, i)

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table holds."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_dict(cls, config: dict) -> "EncoderConfig":
        model_type = config.get("model_type", "bert")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"embedding model type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        roberta = model_type != "bert"
        return cls(model_type=model_type, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                   num_layers=int(config["num_hidden_layers"]), num_heads=int(config["num_attention_heads"]),
                   intermediate_size=int(config["intermediate_size"]), activation=_ACTIVATIONS[act],
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                   max_position_embeddings=int(config.get("max_position_embeddings", 512)),
                   type_vocab_size=int(config.get("type_vocab_size", 2)),
                   position_offset=int(config.get("pad_token_id", 1)) + 1 if roberta else 0)


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {activation!r}")


class LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig, qkv: DenseLinear, out: DenseLinear, norm1: LayerNorm,
                 up: DenseLinear, down: DenseLinear, norm2: LayerNorm):
        super().__init__()
        self.num_heads = config.num_heads
        self.activation = config.activation
        self.qkv, self.out, self.norm1, self.up, self.down, self.norm2 = qkv, out, norm1, up, down, norm2

    def forward(self, x: torch.Tensor, batch: VarlenBatch, attention: Attention) -> torch.Tensor:
        h = self.out(attention(self.qkv(x), batch, self.num_heads))
        h += x
        x = self.norm1(h)
        h = self.down(activate(self.up(x), self.activation))
        h += x
        return self.norm2(h)


class BertEncoder(nn.Module):
    def __init__(self, config: EncoderConfig, word: torch.Tensor, position: torch.Tensor, token_type: torch.Tensor,
                 norm: LayerNorm, layers: list[EncoderLayer]):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Parameter(word, requires_grad=False)
        self.position_embeddings = nn.Parameter(position, requires_grad=False)
        # every input is one segment (type 0): its row is added once, not looked up per token
        self.token_type_row = nn.Parameter(token_type[0].clone(), requires_grad=False)
        self.norm = norm
        self.layers = nn.ModuleList(layers)
        self.attention: Attention = grouped_attention
        self.gemm = "onednn-packed" if layers and layers[0].qkv.packed is not None else "F.linear"

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.dtype

    def forward(self, token_ids: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
        """Token states `[T, H]` of the last layer for `token_ids` `[T]` laid out as `batch` says."""
        positions = batch.positions + self.config.position_offset
        x = self.word_embeddings[token_ids] + self.position_embeddings[positions] + self.token_type_row
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, batch, self.attention)
        return x


def build_encoder(config: EncoderConfig, tensor: Callable[[str], Optional[torch.Tensor]],
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  pack_weights: bool = False) -> BertEncoder:
    """The encoder from checkpoint tensors by Hugging Face name (no "bert."/"roberta." prefix:
    the caller strips it). q, k and v are stacked into one projection. `pack_weights`: the
    projections run on oneDNN with packed weights where that applies (float32 on CPU:
    engine/layers/cpu_gemm.py; `BertEncoder.gemm` says what ran)."""
    def get(name: str) -> torch.Tensor:
        value = tensor(name)
        if value is None:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return value.to(device=device, dtype=dtype)

    def linear(*names: str) -> DenseLinear:
        weight = torch.cat([get(f"{n}.weight") for n in names]) if len(names) > 1 else get(f"{names[0]}.weight")
        bias = torch.cat([get(f"{n}.bias") for n in names]) if len(names) > 1 else get(f"{names[0]}.bias")
        return DenseLinear(weight.contiguous(), bias.contiguous(), pack=pack_weights)

    def norm(name: str) -> LayerNorm:
        return LayerNorm(get(f"{name}.weight"), get(f"{name}.bias"), config.layer_norm_eps)

    layers = []
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}"
        attn = f"{p}.attention.self"
        layers.append(EncoderLayer(config, linear(f"{attn}.query", f"{attn}.key", f"{attn}.value"),
                                   linear(f"{p}.attention.output.dense"), norm(f"{p}.attention.output.LayerNorm"),
                                   linear(f"{p}.intermediate.dense"), linear(f"{p}.output.dense"),
                                   norm(f"{p}.output.LayerNorm")))
    return BertEncoder(config, get("embeddings.word_embeddings.weight"), get("embeddings.position_embeddings.weight"),
                       get("embeddings.token_type_embeddings.weight"), norm("embeddings.LayerNorm"), layers)

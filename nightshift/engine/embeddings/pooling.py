"""Pooling token states into one vector per sequence, L2 normalisation and `dimensions`.

Works on the engine's padding-free layout: every sequence's token states concatenated into
`[T, H]`, sequence i owning rows `cu_seqlens[i]:cu_seqlens[i+1]`. The modes and their order when
several are on are sentence-transformers' (its Pooling concatenates cls, max, mean,
mean_sqrt_len_tokens, lasttoken in that order); every token counts, special ones included, as
there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# sentence-transformers' legacy config keys -> mode, in its concatenation order
_ST_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")


@dataclass(frozen=True)
class PoolingConfig:
    hidden_size: int
    modes: tuple[str, ...] = ("mean",)

    def __post_init__(self):
        unsupported = [m for m in self.modes if m not in MODES]
        if unsupported or not self.modes:
            raise ValueError(f"pooling mode(s) {unsupported or '(none)'} not supported; supported: {', '.join(MODES)}")

    @property
    def dimension(self) -> int:
        """Size of the pooled vector (each mode contributes hidden_size values)."""
        return self.hidden_size * len(self.modes)

    @classmethod
    def from_st_config(cls, config: dict, hidden_size: int) -> "PoolingConfig":
        """From a sentence-transformers pooling config.json (the legacy booleans or `pooling_mode`)."""
        mode = config.get("pooling_mode")
        if mode is not None:
            modes = (mode,) if isinstance(mode, str) else tuple(mode)
        else:
            modes = tuple(name for key, name in _ST_MODE_KEYS.items() if config.get(key, False)) or ("mean",)
        if config.get("include_prompt") is False:
            raise ValueError("pooling with include_prompt=false (prompt-excluding models) is not supported")
        return cls(int(config.get("word_embedding_dimension", hidden_size)), modes)


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """`[num_seqs, config.dimension]` float32 from `hidden` `[T, H]` and `cu_seqlens` `[num_seqs + 1]`."""
    hidden = hidden.float()   # sums in float32 whatever the model ran in
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    lengths = (ends - starts).to(hidden.dtype).clamp_min(1).unsqueeze(1)
    segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), ends - starts)
    pieces = []
    sums = None
    for mode in config.modes:
        if mode == "cls":
            pieces.append(hidden[starts])
        elif mode == "lasttoken":
            pieces.append(hidden[(ends - 1).clamp_min(0)])
        elif mode == "max":
            out = hidden.new_empty(len(starts), hidden.shape[1])
            pieces.append(out.scatter_reduce_(0, segment.unsqueeze(1).expand_as(hidden), hidden, "amax",
                                              include_self=False))
        else:  # mean, mean_sqrt_len_tokens
            if sums is None:
                sums = hidden.new_zeros(len(starts), hidden.shape[1]).index_add_(0, segment, hidden)
            pieces.append(sums / (lengths if mode == "mean" else lengths.sqrt()))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Unit L2 length per row, as sentence-transformers' Normalize (F.normalize, eps 1e-12)."""
    return F.normalize(vectors, p=2, dim=-1)


def truncate_dimensions(vector: torch.Tensor, dimensions: Optional[int], renormalize: bool) -> torch.Tensor:
    """OpenAI's `dimensions`: the first `dimensions` values, re-normalised to unit length when
    the model's vectors are normalised (a prefix of a unit vector is not one)."""
    if dimensions is None or dimensions == vector.shape[-1]:
        return vector
    head = vector[..., :dimensions]
    return normalize(head) if renormalize else head

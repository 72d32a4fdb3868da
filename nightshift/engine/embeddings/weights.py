"""Loading an embedding folder's safetensors into the encoder.

Checkpoints name the encoder's tensors either bare ("embeddings.word_embeddings.weight", as
sentence-transformers saves a BertModel) or under the head model's prefix ("bert.", "roberta.",
as a BertForMaskedLM saves them); old BERT checkpoints call LayerNorm's parameters gamma/beta.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from nightshift.engine.embeddings.bert import BertEncoder, EncoderConfig, build_encoder
from nightshift.engine.layers import cpu_gemm

log = logging.getLogger(__name__)

_ANCHOR = "embeddings.word_embeddings.weight"


class SafetensorsWeights:
    """Tensors by encoder-relative Hugging Face name from one or more safetensors files."""

    def __init__(self, files: list[Path]):
        handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in handles for name in h.keys()}
        anchors = [n for n in self._where if n.endswith(_ANCHOR)]
        if not anchors:
            raise KeyError(f"no {_ANCHOR} in {', '.join(str(f) for f in files)}: not a BERT-family checkpoint")
        self.prefix = min(anchors, key=len)[:-len(_ANCHOR)]

    def tensor(self, name: str) -> Optional[torch.Tensor]:
        for candidate in (self.prefix + name, self.prefix + name.replace("LayerNorm.weight", "LayerNorm.gamma")
                          .replace("LayerNorm.bias", "LayerNorm.beta")):
            handle = self._where.get(candidate)
            if handle is not None:
                return handle.get_tensor(candidate)
        return None


GEMM_PROBE_ROWS = 512     # rows the GEMM choice is measured at (per row, as fast as a full step's)


def load_encoder(config: dict, files: list[Path], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> BertEncoder:
    """The encoder, its float32 projections on CPU run by whichever GEMM this machine runs faster
    (bert.py; ``encoder.gemm`` says which)."""
    encoder_config = EncoderConfig.from_dict(config)
    pack = (dtype == torch.float32 and torch.device(device).type == "cpu"
            and cpu_gemm.packed_is_faster(encoder_config.projection_shapes, GEMM_PROBE_ROWS))
    encoder = build_encoder(encoder_config, SafetensorsWeights(files).tensor, dtype, device, pack_weights=pack)
    log.info("embedding encoder GEMMs: %s", encoder.gemm)
    return encoder.eval()

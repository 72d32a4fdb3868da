"""EmbeddingEngineConfig: every embedding-engine default in one place.

Measured with `python -m bench.embeddings` and alternated runs of 500 of its texts on the 2-core
dev box (AMD EPYC, AVX2), one thread per worker:
- max_batch_tokens: a step's time per token is flat from 256 to 4096 tokens (10.9-11.5 s for the
  500 texts, within noise) and worse at 8192 (13.4 s: the `[T, 1536]` MLP activations leave the
  caches); 2048 sits in the flat part and keeps a step's activations (12 MiB) modest. On an AVX-512
  Zen 5 with oneDNN's packed GEMMs (bert.py), 1,000 texts: 1024 -> 4.27 s, 2048 -> 3.92 s,
  4096 -> 4.24 s: 2048 is the best there too.
- workers: steps run on `workers` threads at once, each with ONE intra-op thread, instead of one
  step at a time on torch's threads: 5.4 s vs 7.0 s for the 500 texts on 2 cores (best of 4),
  and far steadier on a busy machine (median 6.6 s vs 13.5 s): a step's small ops (attention
  over 32-wide heads, GELU, LayerNorm) scale poorly over threads, and OpenMP's barriers stall
  when another process takes a core. None: torch.get_num_threads() workers on CPU, 1 on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from nightshift.engine.config_options import config_from_options

DEFAULT_MAX_BATCH_TOKENS = 2048     # tokens per forward (count x longest of its sequences)
DEFAULT_MAX_BATCH_SEQS = 512        # sequences per forward
DEFAULT_SORT_WINDOW = 8192          # inputs read, tokenized and sorted together from a stream


@dataclass
class EmbeddingEngineConfig:
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_batch_seqs: int = DEFAULT_MAX_BATCH_SEQS
    sort_window: int = DEFAULT_SORT_WINDOW
    workers: Optional[int] = None   # steps run at once, one intra-op thread each (1: inline, torch's threads)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, **options) -> "EmbeddingEngineConfig":
        """A config from keyword options where None means "the default" (unknown names: TypeError)."""
        return config_from_options(cls, "embedding engine", options)

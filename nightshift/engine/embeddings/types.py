"""Public data types of the embedding API: what the service builds and what it reads back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from nightshift.engine.types import RequestError

# One input: a text, or token ids of the model's vocabulary WITHOUT special tokens (the ids
# `tokenizer.encode(text, add_special_tokens=False)` gives; the engine adds [CLS]/[SEP] itself,
# so a text and its token array embed to the same vector).
EmbeddingInput = Union[str, list[int]]


@dataclass
class EmbeddingRequest:
    """One request (one batch line): its inputs are embedded together and answered together."""
    request_id: str
    inputs: list[EmbeddingInput]
    dimensions: Optional[int] = None   # OpenAI's `dimensions`: keep the first N, then re-normalise


@dataclass
class EmbeddingOutput:
    request_id: str
    embeddings: Optional[np.ndarray]    # float32 [len(inputs), dimensions or the model's size]; None on error
    prompt_tokens: int                  # tokens embedded: special tokens included, after truncation
    truncated_inputs: int               # inputs longer than the model's max_seq_length (cut)
    engine_seconds: float = 0.0         # this request's share (by tokens) of the steps its inputs ran in
    finish_time: float = 0.0            # time.time() when its last input's step finished
    error: Optional[RequestError] = None


@dataclass
class EmbeddingStats:
    inputs: int = 0
    prompt_tokens: int = 0
    truncated_inputs: int = 0
    num_steps: int = 0                  # model forwards
    tokenize_seconds: float = 0.0
    model_seconds: float = 0.0          # forwards, pooling included (each step's time / workers: ~ wall time)
    errors: int = 0                     # requests refused

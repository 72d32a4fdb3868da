"""Shards of /v1/embeddings batches through the same shard stream as chat (shard_stream.py):
the same leases, heartbeats, bulk result writes under the lease (exactly once), completion,
finalize wake-ups and hand-backs; only the engine and the two endpoint-specific conversions
differ.

`EmbeddingGenerator` puts the EmbeddingEngine behind the interface the stream drives
(`generate(requests, feed=...)`, `abort`): it embeds a shard's requests in one call (the engine
sorts all their inputs by length and batches them), then, idle, takes the next pending
embeddings shard from the feed, until none is left. `EmbeddingShardStream` turns a row's body
into an EmbeddingRequest and an output into OpenAI's embeddings response body (vectors as
floats, or base64 of their little-endian float32 bytes).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
from sqlalchemy import Row

from nightshift.engine.embeddings import EmbeddingEngine, EmbeddingOutput, EmbeddingRequest
from nightshift.engine.types import RequestFeed
from nightshift.jobs.batches import embeddings
from nightshift.jobs.batches.leases import RequestResult
from nightshift.jobs.batches.models import RequestStatus
from nightshift.jobs.batches.openai_mapping import EMBEDDINGS, RequestBodyError, error_body
from nightshift.settings import Settings
from nightshift.workers.shard_stream import ShardStream, StreamRun


@dataclass
class EmbeddedOutput:
    """An EmbeddingOutput as the shard stream reads outputs (request_id, finish_reason)."""
    output: EmbeddingOutput

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def finish_reason(self) -> str:
        return "error" if self.output.error is not None else "stop"


@dataclass(frozen=True)
class _StreamConfig:
    # ShardStream's low-water mark for taking shards ahead while busy; this generator takes the
    # next shard only once idle, so it is never consulted.
    max_num_seqs: int = 1


class EmbeddingGenerator:
    """The EmbeddingEngine driven like Engine.generate with a RequestFeed."""

    def __init__(self, engine: EmbeddingEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self.config = _StreamConfig()
        self._aborted: set[str] = set()

    def generate(self, requests: Iterable[EmbeddingRequest], offline: bool = True,
                 feed: Optional[RequestFeed] = None) -> Iterator[EmbeddedOutput]:
        batch = list(requests)
        while True:
            live = [r for r in batch if r.request_id not in self._aborted]
            for output in self.engine.embed_requests(live):
                yield EmbeddedOutput(output)
            more = feed.take(0, True) if feed is not None else None
            if more is None:
                return
            batch = list(more)

    def abort(self, request_id: str) -> bool:
        """Requests not yet started are skipped; a started call finishes and the stream drops
        the outputs of the shard whose lease was lost."""
        self._aborted.add(request_id)
        return True


class EmbeddingShardStream(ShardStream):
    endpoints = (EMBEDDINGS,)

    def _engine_request(self, row: Row, endpoint: str) -> EmbeddingRequest:
        try:
            inputs = embeddings.inputs(row.body)
        except embeddings.EmbeddingBodyError as e:   # validated at ingest: only a row edited since
            raise RequestBodyError(e.message, e.param.removeprefix("body."), e.code) from e
        return EmbeddingRequest(str(row.id), inputs, embeddings.dimensions(row.body))

    def _result_of(self, row: Row, out: EmbeddedOutput, endpoint: str) -> RequestResult:
        output = out.output
        if output.error is not None:
            err = output.error
            return RequestResult(row.id, RequestStatus.FAILED, response_status_code=400,
                                 response_body=error_body(err.code, err.message, err.param), finish_reason="error",
                                 finished_at=output.finish_time)
        fmt = embeddings.encoding_format(row.body)
        body = embeddings.response_body(self.engine.model_name, [encode_vector(v, fmt) for v in output.embeddings],
                                        output.prompt_tokens)
        return RequestResult(row.id, RequestStatus.COMPLETED, response_status_code=200, response_body=body,
                             prompt_tokens=output.prompt_tokens, engine_seconds=output.engine_seconds,
                             finished_at=output.finish_time)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A float32 vector as OpenAI sends it: a list of floats, or base64 of its little-endian
    float32 bytes (`np.frombuffer(base64.b64decode(s), "<f4")` reads it back)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float32).tolist()


def run_embedding_shard(shard_id: int, engine: EmbeddingEngine, *, settings: Settings, owner: str, device: str,
                        on_finalize: Callable[[str], None] = lambda batch_id: None,
                        on_released: Callable[[int], None] = lambda shard_id: None) -> StreamRun:
    """Run embeddings shard ``shard_id``, then the pending embeddings shards taken after it
    (as shard_stream.run_shard does for chat)."""
    return EmbeddingShardStream(EmbeddingGenerator(engine), settings, owner, device, on_finalize,
                                on_released).run(shard_id)

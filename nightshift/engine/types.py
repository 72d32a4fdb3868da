"""Public data types of the engine API.

These are the only engine objects the job layer touches: it builds
GenerationRequest objects and reads GenerationOutput objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol


class InvalidRequestError(ValueError):
    """A request the engine refuses. Names the request and carries an OpenAI-style code."""

    def __init__(self, request_id: str, code: str, message: str, param: Optional[str] = None):
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.code = code  # e.g. "context_length_exceeded", "invalid_request", "empty_prompt"
        self.message = message
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or -1) means off
    seed: Optional[int] = None        # same seed, same output, whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False            # return the logprob of each chosen token


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestError:
    code: str
    message: str
    param: Optional[str] = None


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str                # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    first_token_time: Optional[float]  # time.time() of the first generated token
    finish_time: float                 # time.time() when the request finished
    engine_seconds: float = 0.0        # this request's fair share of the engine steps it was in
    logprobs: Optional[list[float]] = None
    error: Optional[RequestError] = None  # set when finish_reason == "error"


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0     # prefix-cache hit tokens
    output_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    requests_finished: int = 0


@dataclass(frozen=True)
class StepReport:
    """One engine step, as told to the engine's step listeners (metrics)."""
    seconds: float
    sequences: int                    # sequences in the step
    tokens: int                       # new tokens processed (prefill chunks + decodes)
    kv_blocks_used: int
    kv_blocks_total: int


class RequestFeed(Protocol):
    """More requests for a running ``Engine.generate`` (a long-running worker streams work in).

    Before every step the engine calls ``take(waiting, idle)``: ``waiting`` is how many of its
    sequences wait for admission, ``idle`` whether it has nothing at all to run. Return the
    requests to add now ([] for none yet), or None once the feed has ended; when ``idle``,
    wait for requests rather than return [] (the engine has nothing else to do)."""

    def take(self, waiting: int, idle: bool) -> Optional[list[GenerationRequest]]: ...

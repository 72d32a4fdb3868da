"""Public data types of the engine API.

These are the only engine objects the job layer touches: it builds
GenerationRequest objects and reads GenerationOutput objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


class InvalidRequestError(ValueError):
    """A request the engine refuses. Names the request and carries an OpenAI-style code."""

    def __init__(self, request_id: str, code: str, message: str, param: Optional[str] = None):
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.code = code  # e.g. "context_length_exceeded", "invalid_request", "empty_prompt"
        self.message = message
        self.param = param


STRUCTURED_KINDS = ("json_schema", "json_object", "lark", "regex")


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output to a grammar (engine/grammar.py compiles it, once per distinct
    grammar, and masks the logits of every step to the tokens it allows).

    kind: "json_schema" (spec: the schema, a dict or its JSON text), "json_object" (any JSON
    object; spec None), "lark" (spec: a Lark grammar, llguidance's dialect), "regex" (spec: a
    pattern the whole output matches). JSON is written compact (no whitespace between tokens).
    param: the request field a refusal of this grammar names (the caller's own name for it,
    e.g. "response_format.json_schema.schema")."""
    kind: str
    spec: Any = None
    param: str = "structured_output"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or -1) means off
    min_p: float = 0.0                # drop tokens below min_p x the most likely one's probability
    seed: Optional[int] = None        # same seed, same output, whatever the batch (choice i: seed + i)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0               # EOS and stop_token_ids are not sampled before this many tokens
    logprobs: bool = False            # return the logprob of each chosen token
    top_logprobs: int = 0             # with logprobs: also the k most likely tokens at each position
    n: int = 1                        # choices; they share the prompt's KV blocks (one prefill)
    # OpenAI's penalties on the tokens generated so far: logit -= frequency x count + presence x (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' / vLLM's: the logit of every token in the prompt or the output so far is
    # divided by it where positive, multiplied where negative (1.0: off)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    structured: Optional[StructuredOutput] = None


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
class Choice:
    """One of a request's n generated answers."""
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str                # "stop" | "length" | "abort" | "error"
    logprobs: Optional[list[float]] = None                        # per token, when asked for
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token: (token id, logprob), best first
    stop_string: Optional[str] = None                             # the stop string that ended it (finish "stop")


@dataclass
class GenerationOutput:
    """A finished request: its choices (one unless SamplingParams.n > 1; none for a refused
    request) and what it cost. ``text``, ``token_ids``, ``finish_reason`` and ``logprobs`` are
    those of choice 0 (the whole answer when n == 1)."""
    request_id: str
    choices: list[Choice]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int             # all choices together
    first_token_time: Optional[float]  # time.time() of the first generated token
    finish_time: float                 # time.time() when the request finished
    engine_seconds: float = 0.0        # this request's fair share of the engine steps it was in
    error: Optional[RequestError] = None  # set for a refused request (finish_reason "error")

    @property
    def finish_reason(self) -> str:
        return "error" if self.error is not None or not self.choices else self.choices[0].finish_reason

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def logprobs(self) -> Optional[list[float]]:
        return self.choices[0].logprobs if self.choices else None


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

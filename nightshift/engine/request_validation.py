"""Whether the engine can run a request: its id, prompt and sampling parameters against the
model's vocabulary and context length and the KV pool's size. A refusal is an InvalidRequestError
naming the request, with an OpenAI-style code and the offending parameter."""
from __future__ import annotations

import math
from typing import NoReturn, Optional

from nightshift.engine.types import GenerationRequest, InvalidRequestError, SamplingParams


def check_request(request, vocab_size: int, max_model_len: int, block_size: int, num_kv_blocks: int) -> None:
    """Raise InvalidRequestError if `request` cannot run on this model and KV pool."""
    rid = getattr(request, "request_id", None)
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(str(rid), "invalid_request",
                                  f"expected a GenerationRequest, got {type(request).__name__}")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(str(rid), "invalid_request", "request_id must be a non-empty string",
                                  "request_id")

    def bad(message: str, param: str, code: str = "invalid_request") -> NoReturn:
        raise InvalidRequestError(rid, code, message, param)

    prompt = request.prompt_token_ids
    if not isinstance(prompt, (list, tuple)) or not prompt:
        bad("prompt is empty", "prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        bad(f"prompt_token_ids must be integers in [0, {vocab_size})", "prompt")
    params = request.sampling
    if not isinstance(params, SamplingParams):
        bad(f"sampling must be SamplingParams, got {type(params).__name__}", "sampling")
    _validate_sampling(params, vocab_size, bad)
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        bad(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens exceeds the "
            f"model's context length of {max_model_len}", "max_tokens", "context_length_exceeded")
    blocks = -(-total // block_size)
    if blocks > num_kv_blocks:
        bad(f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the engine's KV cache has only "
            f"{num_kv_blocks}", "max_tokens", "context_length_exceeded")


def _validate_sampling(params: SamplingParams, vocab_size: int, bad) -> None:
    def number(name: str) -> float:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            bad(f"{name} must be a number, got {value!r}", name)
        return value

    def integer(name: str, allow_none: bool = False) -> Optional[int]:
        value = getattr(params, name)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"{name} must be an integer, got {value!r}", name)
        return value

    if integer("max_tokens") < 1:
        bad(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
    temperature = number("temperature")
    if not 0 <= temperature <= 100 or math.isinf(temperature):
        bad(f"temperature must be between 0 and 100, got {temperature}", "temperature")
    top_p = number("top_p")
    if not 0 < top_p <= 1:
        bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if integer("top_k") < -1:
        bad(f"top_k must be -1, 0 (off) or a positive integer, got {params.top_k}", "top_k")
    integer("seed", allow_none=True)
    for name in ("ignore_eos", "logprobs"):
        if not isinstance(getattr(params, name), bool):
            bad(f"{name} must be true or false, got {getattr(params, name)!r}", name)
    if not isinstance(params.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in params.stop):
        bad(f"stop must be a list of non-empty strings, got {params.stop!r}", "stop")
    if not isinstance(params.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in params.stop_token_ids):
        bad(f"stop_token_ids must be integers in [0, {vocab_size}), got {params.stop_token_ids!r}", "stop_token_ids")

"""Whether the engine can run a request: its id, prompt and sampling parameters against the
model's vocabulary and context length and the KV pool's size. A refusal is an InvalidRequestError
naming the request, with an OpenAI-style code and the offending parameter."""
from __future__ import annotations

import math
from typing import NoReturn, Optional

from nightshift.engine.types import STRUCTURED_KINDS, GenerationRequest, InvalidRequestError, SamplingParams, \
    StructuredOutput

MAX_CHOICES = 128           # n
MAX_TOP_LOGPROBS = 20       # alternatives per token
MAX_PENALTY = 2.0           # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0      # |logit_bias value| (OpenAI's range)


def check_request(request, vocab_size: int, max_model_len: int, block_size: int, num_kv_blocks: int,
                  window: Optional[int] = None, max_chunk: Optional[int] = None) -> None:
    """Raise InvalidRequestError if `request` cannot run on this model and KV pool (`window`: the
    span every layer attends within, ModelConfig.kv_window; `max_chunk`: the step's token budget)."""
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
    blocks = kv_blocks_needed(len(prompt), params.max_tokens, params.n, block_size, window, max_chunk)
    if blocks > num_kv_blocks:
        held = "needs" if window is None else f"holds up to (every layer's window: {window} tokens)"
        bad(f"prompt + max_tokens = {total} tokens (n = {params.n}) {held} {blocks} KV blocks but the engine's KV "
            f"cache has only {num_kv_blocks}", "max_tokens", "context_length_exceeded")


def kv_blocks_needed(prompt_len: int, max_tokens: int, n: int, block_size: int, window: Optional[int] = None,
                     max_chunk: Optional[int] = None) -> int:
    """The most KV blocks a request holds at once: its whole history, plus one per further choice
    (each copies the prompt's last block). Where every layer attends within `window` (the
    scheduler then gives back the blocks out of it, engine/scheduler.py), no more than the blocks
    spanning a window plus a prefill chunk (of at most `max_chunk` tokens) while its prompt runs,
    and a window's blocks per choice while it decodes."""
    total = prompt_len + max_tokens
    whole = -(-total // block_size) + n - 1
    if window is None:
        return whole
    chunk = min(prompt_len, max_chunk or prompt_len)
    prefill = -(-(window - 1 + chunk) // block_size) + 1
    decode = n * (-(-window // block_size) + 1)
    return min(whole, max(prefill, decode))


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
    seed = integer("seed", allow_none=True)
    if seed is not None and not -2**63 <= seed <= 2**64 - 1 - (params.n - 1 if isinstance(params.n, int) else 0):
        bad(f"seed must be a 64-bit integer (choice i draws from seed + i), got {seed}", "seed")
    for name in ("ignore_eos", "logprobs"):
        if not isinstance(getattr(params, name), bool):
            bad(f"{name} must be true or false, got {getattr(params, name)!r}", name)
    if not isinstance(params.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in params.stop):
        bad(f"stop must be a list of non-empty strings, got {params.stop!r}", "stop")
    if not isinstance(params.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in params.stop_token_ids):
        bad(f"stop_token_ids must be integers in [0, {vocab_size}), got {params.stop_token_ids!r}", "stop_token_ids")
    if not 1 <= integer("n") <= MAX_CHOICES:
        bad(f"n must be between 1 and {MAX_CHOICES}, got {params.n}", "n")
    if not 0 <= integer("min_tokens") <= params.max_tokens:
        bad(f"min_tokens must be between 0 and max_tokens ({params.max_tokens}), got {params.min_tokens}", "min_tokens")
    if not 0 <= integer("top_logprobs") <= MAX_TOP_LOGPROBS:
        bad(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {params.top_logprobs}", "top_logprobs")
    if not 0 <= number("min_p") <= 1:
        bad(f"min_p must be in [0, 1], got {params.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= number(name) <= MAX_PENALTY:
            bad(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {getattr(params, name)}", name)
    repetition = number("repetition_penalty")
    if not 0 < repetition or math.isinf(repetition):
        bad(f"repetition_penalty must be a positive number, got {repetition}", "repetition_penalty")
    bias = params.logit_bias
    if not isinstance(bias, dict):
        bad(f"logit_bias must map token ids to numbers, got {bias!r}", "logit_bias")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            bad(f"logit_bias keys must be token ids in [0, {vocab_size}), got {token!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS <= value <= \
                MAX_LOGIT_BIAS:
            bad(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}",
                f"logit_bias.{token}")
    spec = params.structured
    if spec is not None and (not isinstance(spec, StructuredOutput) or spec.kind not in STRUCTURED_KINDS):
        bad(f"structured must be a StructuredOutput of kind {', '.join(STRUCTURED_KINDS)}, got {spec!r}",
            "structured")

"""OpenAI request bodies <-> engine inputs/outputs, as plain data (no engine import here;
workers/ turns the sampling dict into ``engine.SamplingParams``)."""
from __future__ import annotations

import math
from typing import Any, Optional

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"    # its bodies: jobs/batches/embeddings.py
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)


class RequestBodyError(ValueError):
    """A request body the model cannot run; becomes a 400 line in the error file."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Messages with string content (text parts of a content array are joined)."""
    out = []
    for i, msg in enumerate(body.get("messages") or []):
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestBodyError("Only text content parts are supported.", f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise RequestBodyError("'content' must be a string or an array of text parts.", f"messages.{i}.content")
        out.append({"role": msg["role"], "content": content})
    return out


def prompt_token_ids(body: dict[str, Any], endpoint: str, tokenizer) -> list[int]:  # noqa: ANN001
    """Token ids of the prompt: the model's chat template for chat, plain encoding for completions."""
    if endpoint == CHAT:
        return list(tokenizer.apply_chat_template(chat_messages(body), add_generation_prompt=True))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and any(t < 0 or t >= vocab for t in prompt):
            raise RequestBodyError(f"Token ids must be in [0, {vocab}).", "prompt")
        return list(prompt)
    raise RequestBodyError("Unsupported prompt.", "prompt")


def max_tokens_field(body: dict[str, Any]) -> str:
    """The field the body sets its output limit with: ``max_completion_tokens`` (OpenAI's newer
    name, which wins when both are given) or ``max_tokens``; errors name the one that was sent."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def requested_max_tokens(body: dict[str, Any]) -> Optional[int]:
    name = max_tokens_field(body)
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestBodyError(f"'{name}' must be an integer.", name)
    return value


# Planning counts at most this many output tokens per request: a larger max_tokens cannot run
# anyway (context_length_exceeded), and the batch's planned totals must fit their columns.
PLANNED_MAX_TOKENS_CAP = 2**31 - 1


def planned_max_tokens(body: dict[str, Any], endpoint: str, default_chat: int, default_completion: int) -> int:
    """max_tokens used for shard planning (bad values count as 0: those requests fail fast)."""
    try:
        value = requested_max_tokens(body)
    except RequestBodyError:
        return 0
    if value is None:
        return default_chat if endpoint == CHAT else default_completion
    return min(max(value, 0), PLANNED_MAX_TOKENS_CAP)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestBodyError(f"'{name}' must be a number.", name)
    if not lo <= value <= hi:
        raise RequestBodyError(f"'{name}' must be between {lo:g} and {hi:g} (got {value}).", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestBodyError(f"'{name}' must be an integer.", name)
    if not lo <= value <= hi:
        raise RequestBodyError(f"'{name}' must be between {lo} and {hi} (got {value}).", name)
    return value


MAX_TOP_LOGPROBS = 20            # chat: OpenAI's range for top_logprobs is 0..20
MAX_COMPLETION_LOGPROBS = 5      # completions: logprobs is 0..5
LOGIT_BIAS_LIMIT = 100           # logit_bias values are in [-100, 100]


def _check_penalties_and_bias(body: dict[str, Any]) -> None:
    """Values OpenAI accepts are checked as OpenAI checks them; values the engine cannot apply
    (it has no repetition penalties and no logit bias) are refused rather than ignored."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0:
            raise RequestBodyError(f"'{name}' is not supported by this server (its engine applies no "
                                   "repetition penalties); leave it out or send 0.", name, "unsupported_value")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestBodyError("'logit_bias' must be an object mapping token ids to numbers.", "logit_bias")
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise RequestBodyError(f"Invalid key in 'logit_bias': {key!r} is not a token id (a non-negative "
                                   "integer).", "logit_bias")
        param = f"logit_bias.{key}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestBodyError(f"'{param}' must be a number.", param)
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise RequestBodyError(f"'{param}' must be between -{LOGIT_BIAS_LIMIT} and {LOGIT_BIAS_LIMIT} "
                                   f"(got {value}).", param)
    if any(value != 0 for value in bias.values()):
        raise RequestBodyError("'logit_bias' is not supported by this server (its engine applies no logit bias); "
                               "leave it out or send an empty object.", "logit_bias", "unsupported_value")


def _wants_logprobs(body: dict[str, Any], endpoint: str) -> bool:
    """Whether the response carries logprobs. The engine gives the logprob of each chosen token
    and no alternatives, so asking for alternatives (top_logprobs > 0 for chat, logprobs > 0
    for completions) is refused with a clear message instead of being answered without them."""
    logprobs = body.get("logprobs")
    if endpoint == CHAT:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestBodyError("'logprobs' must be a boolean.", "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top:
            if not logprobs:
                raise RequestBodyError("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
            raise RequestBodyError("'top_logprobs' greater than 0 is not supported by this server: it returns "
                                   "the logprob of each chosen token only; send 0 or leave it out.", "top_logprobs",
                                   "unsupported_value")
        return bool(logprobs)
    count = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if count:
        raise RequestBodyError("'logprobs' greater than 0 is not supported by this server: it returns the "
                               "logprob of each chosen token only (send 0).", "logprobs", "unsupported_value")
    return count is not None


def sampling_kwargs(body: dict[str, Any], endpoint: str, prompt_len: int, max_model_len: int,
                    default_chat: int, default_completion: int) -> dict[str, Any]:
    """Keyword arguments for ``engine.SamplingParams`` from an OpenAI body.

    Raises RequestBodyError for values no model could run, naming the field the body used.
    A missing max_tokens takes the default, clamped so prompt + max_tokens fits the context (an
    explicit one is not clamped: the engine then answers context_length_exceeded, as OpenAI
    does)."""
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        default = default_chat if endpoint == CHAT else default_completion
        max_tokens = max(1, min(default, max_model_len - prompt_len))
    elif max_tokens < 1:
        name = max_tokens_field(body)
        raise RequestBodyError(f"'{name}' must be at least 1 (got {max_tokens}).", name)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
        raise RequestBodyError("'stop' must be a string or an array of up to 4 strings.", "stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestBodyError("'seed' must be an integer.", "seed")
    top_k = body.get("top_k", 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise RequestBodyError("'top_k' must be an integer >= -1.", "top_k")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestBodyError("'ignore_eos' must be a boolean.", "ignore_eos")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    _check_penalties_and_bias(body)
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": stop,
        "ignore_eos": ignore_eos,
        "logprobs": _wants_logprobs(body, endpoint),
    }


def error_body(code: str, message: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def usage_body(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(endpoint: str, response_id: str, created: int, model: str, text: str, finish_reason: str,
                  prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  logprobs: Optional[list[float]] = None, tokens: Optional[list[str]] = None,
                  token_bytes: Optional[list[bytes]] = None) -> dict[str, Any]:
    """The body of a successful response, shaped like OpenAI's chat.completion / text_completion.

    ``logprobs``: the logprob of each generated token (when the body asked for them);
    ``tokens``: the text of each generated token, where the caller has it (the token fields
    are null otherwise); ``token_bytes``: each token's own bytes (chat's ``bytes``; without them,
    the UTF-8 of its text). There are no alternatives: ``top_logprobs`` is empty (chat) or null."""
    usage = usage_body(prompt_tokens, cached_tokens, completion_tokens)
    finish_reason = finish_reason if finish_reason in ("stop", "length") else "stop"
    texts: list[Optional[str]] = list(tokens) if tokens is not None and logprobs is not None \
        and len(tokens) == len(logprobs) else [None] * len(logprobs or [])
    if endpoint == CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                  "logprobs": None, "finish_reason": finish_reason}
        if logprobs is not None:
            raw: list[Optional[bytes]] = (
                list(token_bytes) if token_bytes is not None and len(token_bytes) == len(logprobs)
                else [None if t is None else t.encode("utf-8", "replace") for t in texts])
            choice["logprobs"] = {"content": [
                {"token": t, "logprob": lp, "bytes": list(b) if b is not None else None, "top_logprobs": []}
                for t, lp, b in zip(texts, logprobs, raw)], "refusal": None}
        return {"id": f"chatcmpl-{response_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage, "system_fingerprint": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if logprobs is not None:
        known = all(t is not None for t in texts)
        offsets, at = [], 0
        for t in texts if known else []:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {"tokens": texts if known else None, "token_logprobs": logprobs,
                              "top_logprobs": None, "text_offset": offsets if known else None}
    return {"id": f"cmpl-{response_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}

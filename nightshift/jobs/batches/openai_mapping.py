"""OpenAI request bodies <-> engine inputs/outputs, as plain data (no engine import here;
workers/ turns the sampling dict into ``engine.SamplingParams``)."""
from __future__ import annotations

import math
from typing import Any, Optional

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


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
                    raise RequestBodyError("Only text content parts are supported.", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise RequestBodyError("'content' must be a string or an array of text parts.", f"messages[{i}].content")
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


def requested_max_tokens(body: dict[str, Any]) -> Optional[int]:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestBodyError("'max_tokens' must be an integer.", "max_tokens")
    return value


def planned_max_tokens(body: dict[str, Any], endpoint: str, default_chat: int, default_completion: int) -> int:
    """max_tokens used for shard planning (bad values count as 0: those requests fail fast)."""
    try:
        value = requested_max_tokens(body)
    except RequestBodyError:
        return 0
    if value is None:
        return default_chat if endpoint == CHAT else default_completion
    return max(value, 0)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestBodyError(f"'{name}' must be a number.", name)
    if not lo <= value <= hi:
        raise RequestBodyError(f"'{name}' must be between {lo} and {hi} (got {value}).", name)
    return float(value)


def sampling_kwargs(body: dict[str, Any], endpoint: str, prompt_len: int, max_model_len: int,
                    default_chat: int, default_completion: int) -> dict[str, Any]:
    """Keyword arguments for ``engine.SamplingParams`` from an OpenAI body.

    Raises RequestBodyError for values no model could run. A missing max_tokens takes the
    default, clamped so prompt + max_tokens fits the context (an explicit one is not clamped:
    the engine then answers context_length_exceeded, as OpenAI does)."""
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        default = default_chat if endpoint == CHAT else default_completion
        max_tokens = max(1, min(default, max_model_len - prompt_len))
    elif max_tokens < 1:
        raise RequestBodyError("'max_tokens' must be at least 1.", "max_tokens")
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
    logprobs = body.get("logprobs")
    if endpoint == CHAT:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestBodyError("'logprobs' must be a boolean.", "logprobs")
        want_logprobs = bool(logprobs)
    else:
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise RequestBodyError("'logprobs' must be a non-negative integer.", "logprobs")
        want_logprobs = logprobs is not None
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestBodyError("'ignore_eos' must be a boolean.", "ignore_eos")
    return {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": top_k,
        "seed": seed,
        "stop": stop,
        "ignore_eos": ignore_eos,
        "logprobs": want_logprobs,
    }


def error_body(code: str, message: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def usage_body(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(endpoint: str, response_id: str, created: int, model: str, text: str, finish_reason: str,
                  prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  logprobs: Optional[list[float]] = None) -> dict[str, Any]:
    """The body of a successful response, shaped like OpenAI's chat.completion / text_completion."""
    usage = usage_body(prompt_tokens, cached_tokens, completion_tokens)
    finish_reason = finish_reason if finish_reason in ("stop", "length") else "stop"
    if endpoint == CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                  "logprobs": None, "finish_reason": finish_reason}
        if logprobs is not None:
            choice["logprobs"] = {"content": [{"token": None, "logprob": lp} for lp in logprobs]}
        return {"id": f"chatcmpl-{response_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage, "system_fingerprint": None}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = {"token_logprobs": logprobs}
    return {"id": f"cmpl-{response_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}

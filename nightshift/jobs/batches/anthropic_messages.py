"""Anthropic Messages API request ``params`` -> engine inputs, and the Message answering them,
as plain data (the pipeline's /v1/messages endpoint: api/anthropic/ creates such batches).

What a request's ``params`` may hold, each checked when its shard loads (a bad one makes that
request ``errored`` with an ``invalid_request_error`` naming the field; the others run):

- ``model`` (required; a model this server serves), ``max_tokens`` (required, >= 1);
- ``messages`` (required, non-empty): ``role`` user or assistant, alternating, the first a user
  turn; ``content`` a string or an array of ``text`` blocks. A last assistant turn is a prefill:
  the answer continues it (its text may not end in whitespace, as at Anthropic);
- ``system``: a string or an array of text blocks, the template's system message;
- ``stop_sequences`` (strings), ``temperature`` (0-1), ``top_p`` (0-1), ``top_k`` (>= 0; 0: off);
- ``metadata`` (``user_id``), ``service_tier``: accepted, they do not change the answer.
Everything else that would change the answer (images and documents, ``tools``, ``thinking``,
``stream``, ...) is refused by name, never ignored; unknown fields are refused as Anthropic's
API refuses them ("Extra inputs are not permitted").
"""
from __future__ import annotations

import math
from typing import Any, Optional

from nightshift.jobs.batches.request_errors import RequestBodyError

MESSAGES = "/v1/messages"                 # the pipeline's endpoint of Anthropic message batches
MAX_STOP_SEQUENCES = 64
MAX_USER_ID_CHARS = 256

_ACCEPTED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
             "metadata", "service_tier"}
_REFUSED = {  # Anthropic fields that change the answer and this server does not run
    "tools": "tool use is not supported by this server's Message Batches yet",
    "tool_choice": "tool use is not supported by this server's Message Batches yet",
    "thinking": "extended thinking is not supported by this model",
    "stream": "streaming is not supported in batches",
    "mcp_servers": "MCP servers are not supported",
    "container": "code-execution containers are not supported",
    "context_management": "context management is not supported",
    "output_format": "structured output formats are not supported in Message Batches yet",
    "output_config": "output configuration is not supported",
    "inference_geo": "inference regions are not supported",
}


def _fail(param: str, message: str, code: str = "invalid_request") -> RequestBodyError:
    return RequestBodyError(message, param, code)


def _text_blocks(value: Any, param: str) -> str:
    """A content or system value: a string, or an array of text blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(param, "Input should be a valid string or a list of content blocks.")
    parts = []
    for j, block in enumerate(value):
        where = f"{param}.{j}"
        if not isinstance(block, dict):
            raise _fail(where, "Input should be a valid content block (an object with a 'type').")
        kind = block.get("type")
        if kind != "text":
            raise _fail(f"{where}.type", f"Content blocks of type {kind!r} are not supported by this server: only "
                        "'text' blocks are (this model reads no images, documents, tool results or thinking).",
                        "unsupported_value")
        extra = set(block) - {"type", "text", "cache_control", "citations"}
        if extra:
            raise _fail(f"{where}.{sorted(extra)[0]}", "Extra inputs are not permitted.")
        if block.get("citations"):
            raise _fail(f"{where}.citations", "Citations are not supported by this server.", "unsupported_value")
        if not isinstance(block.get("text"), str):
            raise _fail(f"{where}.text", "Field required: a text block needs a string 'text'.")
        parts.append(block["text"])
    return "".join(parts)


def _number(params: dict[str, Any], name: str, lo: float, hi: float) -> Optional[float]:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, f"'{name}' must be a number.")
    if not lo <= value <= hi:
        raise _fail(name, f"'{name}' must be between {lo:g} and {hi:g} (got {value}).")
    return float(value)


def _integer(params: dict[str, Any], name: str, lo: int) -> Optional[int]:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, f"'{name}' must be an integer.")
    if value < lo:
        raise _fail(name, f"'{name}' must be at least {lo} (got {value}).")
    return value


def check_params(params: dict[str, Any], accepted_models: Optional[set[str]] = None) -> None:
    """RequestBodyError naming the first field of ``params`` this server cannot run as asked."""
    for name in params:
        if name in _REFUSED:
            raise _fail(name, f"'{name}': {_REFUSED[name]}.", "unsupported_parameter")
        if name not in _ACCEPTED:
            raise _fail(name, "Extra inputs are not permitted.")
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "Field required: 'model' must be a model name.", "missing_required_parameter")
    if accepted_models is not None and model not in accepted_models:
        raise _fail("model", f"{model!r} is not served here. Available: {', '.join(sorted(accepted_models))}.",
                    "model_not_found")
    if params.get("max_tokens") is None:
        raise _fail("max_tokens", "Field required: 'max_tokens'.", "missing_required_parameter")
    _integer(params, "max_tokens", 1)
    conversation(params)
    stops = params.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _fail("stop_sequences", "'stop_sequences' must be an array of non-empty strings.")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _fail("stop_sequences", f"At most {MAX_STOP_SEQUENCES} stop sequences (got {len(stops)}).")
    _number(params, "temperature", 0.0, 1.0)
    _number(params, "top_p", 0.0, 1.0)
    _integer(params, "top_k", 0)
    metadata = params.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise _fail("metadata", "'metadata' may hold only 'user_id'.")
        user = metadata.get("user_id")
        if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_ID_CHARS):
            raise _fail("metadata.user_id", f"'metadata.user_id' must be a string of at most {MAX_USER_ID_CHARS} "
                        "characters.")
    tier = params.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise _fail("service_tier", "'service_tier' must be 'auto' or 'standard_only'.")


def conversation(params: dict[str, Any]) -> tuple[list[dict[str, str]], Optional[str]]:
    """(template messages with string content, the prefill: a last assistant turn's text or None)."""
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "Field required: 'messages' must be a non-empty array.",
                    "missing_required_parameter" if messages is None else "invalid_request")
    out: list[dict[str, str]] = []
    system = params.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    previous = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _fail(f"messages.{i}", "Input should be an object with 'role' and 'content'.")
        extra = set(msg) - {"role", "content"}
        if extra:
            raise _fail(f"messages.{i}.{sorted(extra)[0]}", "Extra inputs are not permitted.")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise _fail(f"messages.{i}.role", f"Input should be 'user' or 'assistant' (got {role!r}).")
        if i == 0 and role != "user":
            raise _fail("messages.0.role", "The first message must use the 'user' role.")
        if role == previous:
            raise _fail(f"messages.{i}.role", "Roles must alternate between 'user' and 'assistant': messages "
                        f"{i - 1} and {i} are both {role!r}.")
        if "content" not in msg:
            raise _fail(f"messages.{i}.content", "Field required.", "missing_required_parameter")
        out.append({"role": role, "content": _text_blocks(msg["content"], f"messages.{i}.content")})
        previous = role
    prefill = None
    if previous == "assistant":
        prefill = out.pop()["content"]
        if prefill != prefill.rstrip():
            raise _fail(f"messages.{len(messages) - 1}.content", "Final assistant content cannot end with trailing "
                        "whitespace.")
    return out, prefill


def prompt_token_ids(params: dict[str, Any], tokenizer) -> list[int]:  # noqa: ANN001
    """The chat template's prompt, the prefill's tokens after it."""
    messages, prefill = conversation(params)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if prefill:
        ids += list(tokenizer.encode(prefill))
    return ids


def sampling_kwargs(params: dict[str, Any], accepted_models: Optional[set[str]] = None) -> dict[str, Any]:
    """Keyword arguments for ``engine.SamplingParams`` (as openai_mapping.sampling_kwargs gives them)."""
    check_params(params, accepted_models)
    temperature = _number(params, "temperature", 0.0, 1.0)
    top_p = _number(params, "top_p", 0.0, 1.0)
    top_k = _integer(params, "top_k", 0) or 0
    if top_p == 0:
        top_p, top_k = 1.0, 1
    return {"max_tokens": params["max_tokens"], "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p, "top_k": top_k, "stop": list(params.get("stop_sequences") or []),
            "n": 1}


def stop_reason(finish_reason: str, stop_string: Optional[str]) -> tuple[str, Optional[str]]:
    """(Anthropic stop_reason, stop_sequence) of an engine finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def message_body(message_id: str, model: str, text: str, finish_reason: str, stop_string: Optional[str],
                 prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """A Messages API response. Anthropic counts cache reads apart: input_tokens are the prompt
    tokens not read from the prefix cache."""
    reason, sequence = stop_reason(finish_reason, stop_string)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                      "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0,
                      "service_tier": "batch"}}

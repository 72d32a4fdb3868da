"""Every field of OpenAI's chat and completions request bodies (and the vLLM extensions this
server honours), and what happens to it: honoured, refused, or ignored because it means nothing
for a batch on this server. The one table; the README's table is ``markdown_table()`` (a test
keeps them equal), and ``check_fields`` refuses what the table refuses.

- honoured: the field does what OpenAI (or vLLM) says; its checks live where it is mapped
  (openai_mapping, response_formats, tool_calling);
- refused: sent with any value that would change the answer, the request becomes an error line
  (``unsupported_value`` naming the field) instead of being answered without it;
- ignored: the field concerns something this server does not have (stored completions,
  OpenAI's abuse monitoring, service tiers, cache routing): its shape is checked as OpenAI
  checks it, its value changes nothing.

A field in neither OpenAI's spec nor the extensions is refused as OpenAI refuses it
(``unknown_parameter``: "Unrecognized request argument supplied: X"). ``null`` is the same as
leaving a field out, as at OpenAI.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nightshift.jobs.batches.request_errors import RequestBodyError

CHAT = "/v1/chat/completions"          # the endpoints (openai_mapping takes them from here)
COMPLETIONS = "/v1/completions"
BOTH = (CHAT, COMPLETIONS)
HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[str, ...]
    status: str
    what: str                  # what happens, for the README (Markdown)
    vllm: bool = False         # a vLLM extension, not in OpenAI's spec


FIELDS: tuple[RequestField, ...] = (
    # what the request is
    RequestField("model", BOTH, HONOURED, "`default` or the served model's name; one model per batch"),
    RequestField("messages", (CHAT,), HONOURED,
                 "rendered with the model's chat template; text content only (other parts fail validation); "
                 "`tool_calls`, `tool_call_id` and `name` reach the template"),
    RequestField("prompt", (COMPLETIONS,), HONOURED, "a string, one string in an array, or an array of token ids"),
    # how long, how many
    RequestField("max_completion_tokens", (CHAT,), HONOURED,
                 "the output limit (wins over `max_tokens`); unset: the server's default, clamped to the context"),
    RequestField("max_tokens", BOTH, HONOURED, "the output limit (chat: OpenAI's older name)"),
    RequestField("n", BOTH, HONOURED,
                 "1-128 choices from one prefill; choice i samples with `seed` + i; usage counts the prompt once"),
    RequestField("best_of", (COMPLETIONS,), HONOURED,
                 "n <= best_of <= 20: best_of choices run, the n with the highest sum of token logprobs are "
                 "returned, best first; usage counts all of them"),
    RequestField("stop", BOTH, HONOURED, "up to 4 strings; the text ends before the first one"),
    # sampling
    RequestField("temperature", BOTH, HONOURED, "[0, 2]; 0 is greedy"),
    RequestField("top_p", BOTH, HONOURED, "[0, 1]; 0 keeps only the most likely token (as `top_k` 1)"),
    RequestField("seed", BOTH, HONOURED, "same seed, same output, whatever else runs in the batch"),
    RequestField("frequency_penalty", BOTH, HONOURED, "[-2, 2], OpenAI's definition"),
    RequestField("presence_penalty", BOTH, HONOURED, "[-2, 2], OpenAI's definition"),
    RequestField("logit_bias", BOTH, HONOURED, "token ids of this model's vocabulary to [-100, 100]"),
    RequestField("logprobs", BOTH, HONOURED,
                 "chat: `true` gives each token's logprob; completions: 0-5 alternatives per token"),
    RequestField("top_logprobs", (CHAT,), HONOURED, "0-20 alternatives per token, with `logprobs: true`"),
    RequestField("echo", (COMPLETIONS,), HONOURED,
                 "the prompt's text before the completion; refused with `logprobs` (prompt tokens get no logprobs)"),
    # output shape
    RequestField("response_format", (CHAT,), HONOURED,
                 "`text`, `json_object`, `json_schema`: enforced by a grammar whether `strict` is true or false "
                 "(compact JSON)"),
    RequestField("modalities", (CHAT,), HONOURED, "`[\"text\"]`; `\"audio\"` is refused: the model writes text only"),
    RequestField("tools", (CHAT,), HONOURED,
                 "function tools, given to the chat template (or listed in the system message when the template "
                 "has no place for them); `custom` tools are refused"),
    RequestField("tool_choice", (CHAT,), HONOURED,
                 "`none`, `auto` (needs a chat template with a tool-call format), `required` and a named function "
                 "(a grammar forces the call), `allowed_tools`"),
    RequestField("parallel_tool_calls", (CHAT,), HONOURED, "`false`: at most one call per choice"),
    RequestField("functions", (CHAT,), HONOURED,
                 "deprecated: run as `tools`, answered with `message.function_call`"),
    RequestField("function_call", (CHAT,), HONOURED, "deprecated: run as `tool_choice` over `functions`"),
    # refused: the model or the Batch API cannot do them
    RequestField("stream", BOTH, REFUSED, "`true` fails validation (`streaming_unsupported`), as at OpenAI's Batch API"),
    RequestField("stream_options", BOTH, REFUSED, "only allowed with `stream`, which a batch cannot use (as at OpenAI)"),
    RequestField("audio", (CHAT,), REFUSED, "the model writes text only"),
    RequestField("prediction", (CHAT,), REFUSED, "predicted outputs (decoding against given text) are not implemented"),
    RequestField("web_search_options", (CHAT,), REFUSED, "no web search here"),
    RequestField("moderation", (CHAT,), REFUSED, "no moderation model here"),
    RequestField("reasoning_effort", (CHAT,), REFUSED, "anything but `none`: the model does not reason before answering"),
    RequestField("verbosity", (CHAT,), REFUSED, "anything but `medium` (the default): the model has no verbosity control"),
    RequestField("suffix", (COMPLETIONS,), REFUSED, "insertion needs a fill-in-the-middle format the model lacks"),
    # ignored: they concern what this server does not have
    RequestField("metadata", (CHAT,), IGNORED,
                 "tags for OpenAI's stored completions, which do not exist here (checked: up to 16 string pairs)"),
    RequestField("store", (CHAT,), IGNORED, "results are kept in the batch's output file either way"),
    RequestField("user", BOTH, IGNORED, "an end-user id for OpenAI's abuse monitoring"),
    RequestField("safety_identifier", (CHAT,), IGNORED, "an end-user id for OpenAI's abuse monitoring (checked: 128 "
                 "characters at most)"),
    RequestField("service_tier", (CHAT,), IGNORED, "a batch has one tier"),
    RequestField("prompt_cache_key", (CHAT,), IGNORED,
                 "the engine's prefix cache matches prompts by their tokens; no key routes them"),
    RequestField("prompt_cache_options", (CHAT,), IGNORED, "the prefix cache keeps entries while the engine runs"),
    RequestField("prompt_cache_retention", (CHAT,), IGNORED, "the prefix cache keeps entries while the engine runs"),
    # vLLM's extensions
    RequestField("top_k", BOTH, HONOURED, "-1 or 0 (off), or the k most likely tokens", vllm=True),
    RequestField("min_p", BOTH, HONOURED, "[0, 1] of the most likely token's probability", vllm=True),
    RequestField("repetition_penalty", BOTH, HONOURED, "> 0, vLLM's and transformers' definition (1: off)", vllm=True),
    RequestField("min_tokens", BOTH, HONOURED, "0 to max_tokens: no EOS or stop token before that many", vllm=True),
    RequestField("ignore_eos", BOTH, HONOURED, "keep generating past EOS up to max_tokens", vllm=True),
    RequestField("stop_token_ids", BOTH, HONOURED, "token ids that end the output (kept out of the text)", vllm=True),
    RequestField("response_format", (COMPLETIONS,), HONOURED, "as on chat", vllm=True),
)

_BY_ENDPOINT: dict[str, dict[str, RequestField]] = {
    endpoint: {f.name: f for f in FIELDS if endpoint in f.endpoints} for endpoint in BOTH}


def fields_of(endpoint: str) -> dict[str, RequestField]:
    return _BY_ENDPOINT[endpoint]


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Refuse unknown fields and the values the table refuses; check the shape of ignored ones.
    The honoured fields are checked where they are mapped."""
    known = _BY_ENDPOINT[endpoint]
    for name in body:
        if name not in known:
            raise RequestBodyError(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    for name, value in body.items():
        check = _CHECKS.get(name)
        if check is not None and value is not None:
            check(value)


def _unsupported(name: str, why: str) -> RequestBodyError:
    return RequestBodyError(f"'{name}' is not supported by this server: {why}.", name, "unsupported_value")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RequestBodyError(f"Invalid value for '{name}': {value!r}. Supported values are: "
                               + ", ".join(f"'{a}'" for a in allowed) + ".", name, "invalid_value")


def _string(name: str, value: Any, max_chars: int = 0) -> None:
    if not isinstance(value, str):
        raise RequestBodyError(f"'{name}' must be a string.", name)
    if max_chars and len(value) > max_chars:
        raise RequestBodyError(f"'{name}' is longer than {max_chars} characters ({len(value)}).", name)


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise RequestBodyError(f"'{name}' must be a boolean.", name)


def _refused(name: str, why: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        raise _unsupported(name, why)
    return check


def _stream(value: Any) -> None:
    _boolean("stream", value)
    if value:
        raise RequestBodyError("Streaming is not supported in the Batch API.", "stream", "streaming_unsupported")


def _stream_options(value: Any) -> None:
    raise RequestBodyError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           "stream_options")


def _modalities(value: Any) -> None:
    if not isinstance(value, list):
        raise RequestBodyError("'modalities' must be an array.", "modalities")
    for i, item in enumerate(value):
        _one_of(f"modalities.{i}", item, ("text", "audio"))
    if "audio" in value:
        raise _unsupported("modalities", "the model writes text only (send [\"text\"])")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_effort(value: Any) -> None:
    _one_of("reasoning_effort", value, REASONING_EFFORTS)
    if value != "none":
        raise _unsupported("reasoning_effort", "the model does not reason before answering (send \"none\" or "
                                               "leave it out)")


def _verbosity(value: Any) -> None:
    _one_of("verbosity", value, ("low", "medium", "high"))
    if value != "medium":
        raise _unsupported("verbosity", "the model has no verbosity control (send \"medium\" or leave it out)")


def _suffix(value: Any) -> None:
    _string("suffix", value)
    if value:
        raise _unsupported("suffix", "inserting text before a suffix needs a fill-in-the-middle format this model "
                                     "lacks")


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _metadata(value: Any) -> None:
    if not isinstance(value, dict):
        raise RequestBodyError("'metadata' must be an object of string values.", "metadata")
    if len(value) > METADATA_PAIRS:
        raise RequestBodyError(f"'metadata' has more than {METADATA_PAIRS} pairs ({len(value)}).", "metadata")
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise RequestBodyError(f"'metadata' keys are at most {METADATA_KEY_CHARS} characters.", "metadata")
        _string(f"metadata.{key}", item, METADATA_VALUE_CHARS)


def _prompt_cache_options(value: Any) -> None:
    if not isinstance(value, dict):
        raise RequestBodyError("'prompt_cache_options' must be an object.", "prompt_cache_options")
    for key, item in value.items():
        if key == "mode":
            _one_of("prompt_cache_options.mode", item, ("implicit", "explicit"))
        elif key == "ttl":
            _one_of("prompt_cache_options.ttl", item, ("30m",))
        else:
            raise RequestBodyError(f"Unrecognized request argument supplied: prompt_cache_options.{key}",
                                   f"prompt_cache_options.{key}", "unknown_parameter")


_CHECKS: dict[str, Callable[[Any], None]] = {
    "stream": _stream,
    "stream_options": _stream_options,
    "audio": _refused("audio", "the model writes text only"),
    "modalities": _modalities,
    "prediction": _refused("prediction", "predicted outputs are not implemented"),
    "web_search_options": _refused("web_search_options", "there is no web search here"),
    "moderation": _refused("moderation", "there is no moderation model here"),
    "reasoning_effort": _reasoning_effort,
    "verbosity": _verbosity,
    "suffix": _suffix,
    "metadata": _metadata,
    "store": lambda value: _boolean("store", value),
    "user": lambda value: _string("user", value),
    "safety_identifier": lambda value: _string("safety_identifier", value, 128),
    "service_tier": lambda value: _one_of("service_tier", value, ("auto", "default", "flex", "scale", "priority",
                                                                  "fast")),
    "prompt_cache_key": lambda value: _string("prompt_cache_key", value),
    "prompt_cache_options": _prompt_cache_options,
    "prompt_cache_retention": lambda value: _one_of("prompt_cache_retention", value, ("in_memory", "24h")),
}


def markdown_table() -> str:
    """The README's table of every field (tests/unit/test_request_fields.py keeps them equal)."""
    names = {CHAT: "chat", COMPLETIONS: "completions"}
    rows = ["| field | endpoints | status | what happens |", "| --- | --- | --- | --- |"]
    for f in FIELDS:
        where = " and ".join(names[e] for e in f.endpoints) + (" (vLLM)" if f.vllm else "")
        rows.append(f"| `{f.name}` | {where} | {f.status} | {f.what} |")
    return "\n".join(rows)

"""Request bodies -> engine inputs, as plain data (no engine import here; workers/ turns
the sampling dict into ``engine.SamplingParams``, its ``structured`` dict into
``engine.StructuredOutput``). Which fields a body may hold and what happens to each:
request_fields.py; the chat as the template sees it: chat_history.py; response_format:
response_formats.py; tools: tool_calling.py; the response bodies: response_bodies.py. The
/v1/messages bodies of Anthropic message batches (``params``): anthropic_messages.py."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from nightshift.jobs.batches import anthropic_messages
from nightshift.jobs.batches.anthropic_messages import MESSAGES
from nightshift.jobs.batches.chat_history import chat_messages, chat_prompt
from nightshift.jobs.batches.request_errors import RequestBodyError, error_body
from nightshift.jobs.batches.request_fields import CHAT, COMPLETIONS, check_fields
from nightshift.jobs.batches.response_formats import structured_output
from nightshift.jobs.batches.tool_calling import NO_TOOLS, ToolPlan, tool_grammar, tool_plan

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "ENDPOINTS", "MESSAGES", "RequestBodyError", "error_body", "chat_messages",
           "chat_prompt", "prompt_token_ids", "sampling_kwargs", "response_plan", "ResponsePlan"]

EMBEDDINGS = "/v1/embeddings"    # its bodies: jobs/batches/embeddings.py
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)    # OpenAI's: a /v1/batches file may name these


def prompt_token_ids(body: dict[str, Any], endpoint: str, tokenizer) -> list[int]:  # noqa: ANN001
    """Token ids of the prompt: the model's chat template for chat (with the body's tools),
    plain encoding for completions."""
    if endpoint == MESSAGES:
        return anthropic_messages.prompt_token_ids(body, tokenizer)
    if endpoint == CHAT:
        messages, tools = chat_prompt(body, getattr(tokenizer, "tool_support", None))
        extra = {"tools": tools} if tools else {}
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))
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
    """Output tokens planned for a request: max_tokens for each choice that runs (n, or best_of);
    bad values count as 0 (those requests fail fast)."""
    try:
        value = requested_max_tokens(body)
        runs = _choices(body, endpoint)[1]
    except RequestBodyError:
        return 0
    if value is None:
        value = default_completion if endpoint == COMPLETIONS else default_chat
    return min(max(value, 0) * runs, PLANNED_MAX_TOKENS_CAP)


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


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestBodyError(f"'{name}' must be a boolean.", name)
    return bool(value)


MAX_TOP_LOGPROBS = 20            # chat: OpenAI's range for top_logprobs is 0..20
MAX_COMPLETION_LOGPROBS = 5      # completions: logprobs is 0..5
LOGIT_BIAS_LIMIT = 100           # logit_bias values are in [-100, 100]
PENALTY_LIMIT = 2                # frequency_penalty, presence_penalty are in [-2, 2]
MAX_CHOICES = 128                # n
MAX_BEST_OF = 20                 # completions' best_of
MAX_STOP_STRINGS = 4


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """Token id strings -> numbers in [-100, 100], as OpenAI checks them; ids are this model's
    (the engine refuses one outside its vocabulary, naming ``logit_bias.<id>``)."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestBodyError("'logit_bias' must be an object mapping token ids to numbers.", "logit_bias")
    out: dict[int, float] = {}
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
        if value != 0:
            out[int(key)] = float(value)
    return out


def _logprobs(body: dict[str, Any], endpoint: str) -> tuple[bool, int]:
    """(whether the answer carries logprobs, how many alternatives per token). Chat:
    ``logprobs`` true and ``top_logprobs`` 0-20 (which needs logprobs); completions:
    ``logprobs`` 0-5, the number of alternatives (null: none at all)."""
    if endpoint == CHAT:
        logprobs = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise RequestBodyError("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        return logprobs, top or 0
    count = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return count is not None, count or 0


def _choices(body: dict[str, Any], endpoint: str) -> tuple[int, int]:
    """(choices returned, choices run): n, and completions' best_of (>= n) when given."""
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    if endpoint != COMPLETIONS:
        return n, n
    best_of = _integer(body, "best_of", 1, MAX_BEST_OF)
    if best_of is None:
        return n, n
    if best_of < n:
        raise RequestBodyError(f"'best_of' must be greater than or equal to 'n' (got best_of {best_of}, n {n}).",
                               "best_of")
    return n, best_of


def _echo(body: dict[str, Any], endpoint: str) -> bool:
    """Completions' echo: the prompt's text before the completion. Not with logprobs: OpenAI gives
    the prompt's tokens logprobs too, and the engine computes none for the prompt."""
    if endpoint != COMPLETIONS:
        return False
    echo = _boolean(body, "echo")
    if echo and body.get("logprobs") is not None:
        raise RequestBodyError("'echo' with 'logprobs' is not supported by this server: it computes no logprobs for "
                               "the prompt's tokens. Leave out one of them.", "echo", "unsupported_value")
    return echo


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > MAX_STOP_STRINGS:
        raise RequestBodyError("'stop' must be a string or an array of up to 4 strings.", "stop")
    return [s for s in stop if s]      # an empty stop string stops nothing


def _stop_token_ids(body: dict[str, Any]) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestBodyError("'stop_token_ids' must be an array of token ids (non-negative integers).",
                               "stop_token_ids")
    return list(ids)


def _repetition_penalty(body: dict[str, Any]) -> float:
    """vLLM's rule: any finite number above 0 (1 is off; above 1 discourages repeats)."""
    value = body.get("repetition_penalty")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestBodyError("'repetition_penalty' must be a number.", "repetition_penalty")
    if value <= 0:
        raise RequestBodyError(f"'repetition_penalty' must be greater than 0 (got {value}).", "repetition_penalty")
    return float(value)


def _structured(body: dict[str, Any], endpoint: str, tool_format: Optional[str]) -> Optional[dict[str, Any]]:
    """The grammar the output must follow: a forced tool call's, else response_format's."""
    fmt = structured_output(body)
    plan = tool_plan(body) if endpoint == CHAT else NO_TOOLS
    if plan.mode == "auto":
        if tool_format is None:
            choice, forced = (("function_call", "'function_call': {\"name\": ...}") if plan.legacy else
                              ("tool_choice", "'tool_choice': 'required' or a named function"))
            raise RequestBodyError(f"This model's chat template has no tool-call format, so the model cannot choose "
                                   f"whether to call a function ({choice} 'auto'). Send {forced} to force a call, "
                                   "or 'none'.", plan.field, "unsupported_value")
        if fmt is not None:
            raise RequestBodyError("'response_format' cannot be enforced while the model may choose to call a tool "
                                   "('auto'): force the call (a named function or 'required') or send tool_choice "
                                   "'none'.", "response_format", "unsupported_value")
        return None
    return tool_grammar(plan) if plan.forced else fmt


def sampling_kwargs(body: dict[str, Any], endpoint: str, prompt_len: int, max_model_len: int,
                    default_chat: int, default_completion: int, tool_format: Optional[str] = None,
                    accepted_models: Optional[set[str]] = None) -> dict[str, Any]:
    """Keyword arguments for ``engine.SamplingParams`` from an OpenAI body (``structured`` is a
    dict for ``engine.StructuredOutput``, or None).

    Raises RequestBodyError for a body no model could run or this server does not run, naming
    the field the body used. A missing max_tokens takes the default, clamped so prompt +
    max_tokens fits the context (an explicit one is not clamped: the engine then answers
    context_length_exceeded, as OpenAI does). ``tool_format``: the model's own tool-call format
    (engine/tool_formats.py), None when its chat template has none. ``accepted_models``: the
    names a /v1/messages body's model may be (OpenAI bodies' models are checked at ingest)."""
    if endpoint == MESSAGES:
        return anthropic_messages.sampling_kwargs(body, accepted_models)
    check_fields(body, endpoint)
    max_tokens = requested_max_tokens(body)
    if max_tokens is None:
        default = default_chat if endpoint == CHAT else default_completion
        max_tokens = max(1, min(default, max_model_len - prompt_len))
    elif max_tokens < 1:
        name = max_tokens_field(body)
        raise RequestBodyError(f"'{name}' must be at least 1 (got {max_tokens}).", name)
    seed = _integer(body, "seed", -2**63, 2**63 - 1)      # OpenAI's range (a 64-bit integer)
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise RequestBodyError("'top_k' must be an integer >= -1.", "top_k")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:       # the smallest set of tokens with probability >= 0 is the most likely one
        top_p, top_k = 1.0, 1
    min_tokens = _integer(body, "min_tokens", 0, 2**31 - 1) or 0
    if min_tokens > max_tokens:
        raise RequestBodyError(f"'min_tokens' must be at most max_tokens ({max_tokens}), got {min_tokens}.",
                               "min_tokens")
    logprobs, top_logprobs = _logprobs(body, endpoint)
    n, runs = _choices(body, endpoint)
    _echo(body, endpoint)
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "seed": seed,
        "stop": _stop(body),
        "stop_token_ids": _stop_token_ids(body),
        "ignore_eos": _boolean(body, "ignore_eos"),
        "min_tokens": min_tokens,
        "logprobs": logprobs or runs > n,          # best_of ranks its choices by their logprobs
        "top_logprobs": top_logprobs,
        "n": runs,
        "presence_penalty": _number(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
        "repetition_penalty": _repetition_penalty(body),
        "logit_bias": _logit_bias(body),
        "structured": _structured(body, endpoint, tool_format),
    }


@dataclass(frozen=True)
class ResponsePlan:
    """What shapes the answer of a body ``sampling_kwargs`` accepted."""
    choices: int                  # returned (best_of runs more)
    logprobs: bool                # the answer carries logprobs
    top_logprobs: int             # alternatives per token
    echo: bool                    # completions: the prompt's text first
    tools: ToolPlan = NO_TOOLS


def response_plan(body: dict[str, Any], endpoint: str) -> ResponsePlan:
    if endpoint == MESSAGES:
        return ResponsePlan(1, False, 0, False)
    logprobs, top_logprobs = _logprobs(body, endpoint)
    return ResponsePlan(_choices(body, endpoint)[0], logprobs, top_logprobs, _echo(body, endpoint),
                        tool_plan(body) if endpoint == CHAT else NO_TOOLS)

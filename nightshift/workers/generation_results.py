"""Between a row's OpenAI body and the engine, in an engine worker: the engine's SamplingParams
of an accepted body, and a finished ``GenerationOutput`` as the row's result, its OpenAI
response body (jobs/batches/response_bodies.py) or the engine's refusal as a 400 error body;
a /v1/messages row's result is an Anthropic Message (jobs/batches/anthropic_messages.py).

The body's choices: the engine's, in order, or best_of's best n (highest sum of token
logprobs, best first). Each with its logprobs (token texts and bytes decoded one token at a
time, the alternatives' too), and its tool calls: read from a forced call's JSON, or parsed from
the model's own tool-call format (engine/tool_formats.py) when it was free to call
(``tool_choice`` auto). A free answer that names a function the body did not offer is left as
content: it calls nothing the client can run.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import Row

from nightshift.engine import GenerationOutput, SamplingParams
from nightshift.engine.tool_formats import parse_tool_calls
from nightshift.engine.types import Choice, StructuredOutput
from nightshift.jobs.batches.leases import RequestResult
from nightshift.jobs.batches.models import RequestStatus
from nightshift.jobs.batches.anthropic_messages import MESSAGES, message_body
from nightshift.jobs.batches.openai_mapping import ResponsePlan, error_body, response_plan
from nightshift.jobs.batches.response_bodies import ChoiceOutput, TokenLogprob, ToolCall, response_body
from nightshift.jobs.batches.tool_calling import forced_calls
from nightshift.jobs.ids import message_id, response_request_id, tool_call_id


def engine_sampling(kwargs: dict[str, Any]) -> SamplingParams:
    """``openai_mapping.sampling_kwargs``'s dict as the engine's SamplingParams."""
    structured = kwargs.get("structured")
    return SamplingParams(**{**kwargs, "structured": StructuredOutput(**structured) if structured else None})


def tool_format_of(engine) -> Optional[str]:  # noqa: ANN001
    """The tool-call format the engine's chat template teaches its model (None: none)."""
    support = getattr(getattr(engine, "tokenizer", None), "tool_support", None)
    return getattr(support, "format", None)


class TokenPieces:
    """Each token's text and own bytes, decoded on its own with special tokens kept, once per id.
    A token that is part of a multi-byte character decodes to U+FFFD, as in OpenAI's ``token``
    field, and keeps its own bytes in ``bytes``. Without a tokenizer: (None, None)."""

    def __init__(self, tokenizer):  # noqa: ANN001
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[Optional[str], Optional[bytes]]] = {}

    def __call__(self, token_id: int) -> tuple[Optional[str], Optional[bytes]]:
        if self.tokenizer is None:
            return None, None
        piece = self._known.get(token_id)
        if piece is None:
            piece = self._known[token_id] = (self.tokenizer.decode([token_id], skip_special_tokens=False),
                                             self.tokenizer.token_bytes(token_id))
        return piece


def token_pieces(tokenizer, token_ids: list[int]) -> tuple[Optional[list[str]], Optional[list[bytes]]]:  # noqa: ANN001
    """The text and the bytes of each token (TokenPieces); (None, None) without a tokenizer."""
    if tokenizer is None:
        return None, None
    pieces = TokenPieces(tokenizer)
    both = [pieces(token_id) for token_id in token_ids]
    return [text for text, _ in both], [raw for _, raw in both]   # type: ignore[misc]


def generation_result(row: Row, out: GenerationOutput, endpoint: str, model_name: str, tokenizer=None,  # noqa: ANN001
                      tool_format: Optional[str] = None) -> RequestResult:
    if out.error is not None or not out.choices:
        err = out.error
        code, message, param = (err.code, err.message, err.param) if err else ("invalid_request", "rejected", None)
        return RequestResult(row.id, RequestStatus.FAILED, response_status_code=400,
                             response_body=error_body(code, message, param), finish_reason="error",
                             prompt_tokens=0, finished_at=out.finish_time)
    if endpoint == MESSAGES:
        return _message_result(row, out, model_name)
    plan = response_plan(row.body, endpoint)
    pieces = TokenPieces(tokenizer)
    echo = _prompt_text(row, tokenizer) if plan.echo else ""
    choices = [_choice_output(c, i, row.id, plan, pieces, tool_format, echo)
               for i, c in enumerate(_returned(out.choices, plan.choices))]
    body = response_body(endpoint, response_request_id(row.id), int(out.finish_time), model_name, choices,
                         out.prompt_tokens, out.cached_prompt_tokens, out.completion_tokens, plan.top_logprobs)
    return RequestResult(row.id, RequestStatus.COMPLETED, response_status_code=200, response_body=body,
                         finish_reason=body["choices"][0]["finish_reason"], prompt_tokens=out.prompt_tokens,
                         cached_tokens=out.cached_prompt_tokens, completion_tokens=out.completion_tokens,
                         engine_seconds=out.engine_seconds, first_token_at=out.first_token_time,
                         finished_at=out.finish_time)


def _message_result(row: Row, out: GenerationOutput, model_name: str) -> RequestResult:
    """An Anthropic message batch's request: a Messages API response (anthropic_messages.py)."""
    choice = out.choices[0]
    body = message_body(message_id(row.id), row.body.get("model") or model_name, choice.text, choice.finish_reason,
                        choice.stop_string, out.prompt_tokens, out.cached_prompt_tokens, out.completion_tokens)
    return RequestResult(row.id, RequestStatus.COMPLETED, response_status_code=200, response_body=body,
                         finish_reason=choice.finish_reason if choice.finish_reason in ("stop", "length") else "stop",
                         prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_prompt_tokens,
                         completion_tokens=out.completion_tokens, engine_seconds=out.engine_seconds,
                         first_token_at=out.first_token_time, finished_at=out.finish_time)


def _returned(choices: list[Choice], count: int) -> list[Choice]:
    """The choices in order, or (best_of ran more) the ``count`` with the highest sum of logprobs."""
    ordered = sorted(choices, key=lambda c: c.index)
    if len(ordered) <= count:
        return ordered
    return sorted(ordered, key=lambda c: -sum(c.logprobs or ()))[:count]


def _prompt_text(row: Row, tokenizer) -> str:  # noqa: ANN001
    prompt = row.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(row.prompt_token_ids), skip_special_tokens=False) if tokenizer is not None else ""


def _choice_output(c: Choice, index: int, row_id: int, plan: ResponsePlan, pieces: TokenPieces,
                   tool_format: Optional[str], echo: str) -> ChoiceOutput:
    logprobs = _token_logprobs(c, pieces) if plan.logprobs and c.logprobs is not None else None
    tools = plan.tools
    text: Optional[str] = echo + c.text
    calls: list[tuple[str, str]] = []
    if tools.forced:
        calls = forced_calls(tools, c.text)
        text = None if calls else c.text
    elif tools.mode == "auto" and tool_format is not None:
        content, parsed = parse_tool_calls(tool_format, c.text)
        offered = {t.name for t in tools.tools}
        if parsed and all(p.name in offered for p in parsed):
            text, calls = content, [(p.name, p.arguments) for p in parsed]
    if not calls:
        return ChoiceOutput(text, c.finish_reason, logprobs)
    if not tools.parallel:
        calls = calls[:1]
    return ChoiceOutput(text, c.finish_reason, logprobs,
                        [ToolCall(tool_call_id(row_id, index, k), name, arguments)
                         for k, (name, arguments) in enumerate(calls)], tools.legacy)


def _token_logprobs(c: Choice, pieces: TokenPieces) -> list[TokenLogprob]:
    known = len(c.token_ids) == len(c.logprobs or ())
    top = c.top_logprobs or []
    out = []
    for j, logprob in enumerate(c.logprobs or ()):
        token, raw = pieces(c.token_ids[j]) if known else (None, None)
        alternatives = [(*pieces(token_id), alt) for token_id, alt in (top[j] if j < len(top) else ())]
        out.append(TokenLogprob(token, raw, logprob, alternatives))
    return out


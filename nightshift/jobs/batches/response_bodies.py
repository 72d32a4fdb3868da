"""The bodies of successful responses, shaped like OpenAI's ``chat.completion`` and
``text_completion`` (the openai client's own types parse them: tests/unit/test_response_bodies.py).

The worker turns each engine choice into a ``ChoiceOutput`` (token texts decoded, tool calls
parsed); this module only shapes them. Usage counts the prompt once and the completion tokens of
every choice that ran (best_of's unreturned ones too, as OpenAI bills them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from nightshift.jobs.batches.request_fields import CHAT


@dataclass
class TokenLogprob:
    """One generated token: its text (None where the caller has none; U+FFFD for part of a
    multi-byte character), its own bytes, its logprob, and the alternatives asked for, best first."""
    token: Optional[str]
    bytes: Optional[bytes]
    logprob: float
    top: list[tuple[Optional[str], Optional[bytes], float]] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str                  # JSON text (a prefix of it when the output was cut)


@dataclass
class ChoiceOutput:
    text: Optional[str]             # the message content (None beside tool calls) or the completion text
    finish_reason: str              # the engine's: "stop" | "length" (anything else answers "stop")
    logprobs: Optional[list[TokenLogprob]] = None     # when the body asked for them
    tool_calls: Optional[list[ToolCall]] = None       # chat: the calls the answer makes
    function_call: bool = False     # the deprecated shape: the (one) call as message.function_call

    @property
    def openai_finish_reason(self) -> str:
        reason = self.finish_reason if self.finish_reason in ("stop", "length") else "stop"
        if self.tool_calls and reason == "stop":     # a cut call keeps "length": its arguments are a prefix
            return "function_call" if self.function_call else "tool_calls"
        return reason


def usage_body(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(endpoint: str, response_id: str, created: int, model: str, choices: list[ChoiceOutput],
                  prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  top_logprobs: int = 0) -> dict[str, Any]:
    """``top_logprobs``: how many alternatives were asked for (completions answer null for 0)."""
    usage = usage_body(prompt_tokens, cached_tokens, completion_tokens)
    if endpoint == CHAT:
        return {"id": f"chatcmpl-{response_id}", "object": "chat.completion", "created": created, "model": model,
                "choices": [_chat_choice(i, c) for i, c in enumerate(choices)], "usage": usage,
                "system_fingerprint": None}
    return {"id": f"cmpl-{response_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(i, c, top_logprobs) for i, c in enumerate(choices)], "usage": usage}


def _chat_choice(index: int, c: ChoiceOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.tool_calls and c.function_call:
        call = c.tool_calls[0]
        message["function_call"] = {"name": call.name, "arguments": call.arguments}
    elif c.tool_calls:
        message["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                                 for t in c.tool_calls]
    logprobs = None
    if c.logprobs is not None:
        logprobs = {"content": [dict(_chat_token(t.token, t.bytes, t.logprob),
                                     top_logprobs=[_chat_token(*alt) for alt in t.top]) for t in c.logprobs],
                    "refusal": None}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.openai_finish_reason}


def _chat_token(token: Optional[str], raw: Optional[bytes], logprob: float) -> dict[str, Any]:
    if raw is None and token is not None:
        raw = token.encode("utf-8", "replace")
    return {"token": token, "logprob": logprob, "bytes": list(raw) if raw is not None else None}


def _completion_choice(index: int, c: ChoiceOutput, top_logprobs: int) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None:
        texts = [t.token for t in c.logprobs]
        known = all(t is not None for t in texts)
        offsets, at = [], 0
        for t in texts if known else []:
            offsets.append(at)
            at += len(t)
        alternatives = None
        if top_logprobs:
            alternatives = []
            for t in c.logprobs:
                best: dict[str, float] = {}
                for text, _, logprob in t.top:
                    if text is not None:
                        best.setdefault(text, logprob)     # two ids with one text: the likelier one
                alternatives.append(best)
        logprobs = {"tokens": texts if known else None, "token_logprobs": [t.logprob for t in c.logprobs],
                    "top_logprobs": alternatives, "text_offset": offsets if known else None}
    return {"index": index, "text": c.text or "", "logprobs": logprobs, "finish_reason": c.openai_finish_reason}

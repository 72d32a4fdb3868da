"""Tool calls in a model's own words: what a chat template teaches the model about tools (read
from the template's text), and a finished output parsed into its content and its calls.

A model trained for function calling writes its calls in one fixed format, the one its chat
template describes when it is given ``tools``. Three families cover the open models this engine
runs (Llama, Qwen, Mistral shapes):

- ``hermes`` (Qwen2/2.5/3, Hermes, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 templates) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), content before the marker.

The engine's text skips special tokens, and ``<|python_tag|>`` and ``[TOOL_CALLS]`` are special
in their tokenizers, so each parser also accepts its calls without the marker. An output that
does not parse as calls (a cut-off call, prose that merely mentions one) is content, as written.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str          # the arguments object as JSON text


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template does with tools: ``format`` the call format it teaches (None: none
    this module reads), whether it renders the ``tools`` list and assistant ``tool_calls``."""
    format: Optional[str]
    renders_tools: bool
    renders_tool_calls: bool


def tool_support(template: Optional[str]) -> ToolSupport:
    """Read from the template's text (a template that never names ``tools`` cannot show them)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        format_: Optional[str] = "mistral"
    elif "<tool_call>" in text:
        format_ = "hermes"
    elif "<|python_tag|>" in text or re.search(r'"parameters": dictionary', text):
        format_ = "llama3_json"
    else:
        format_ = None
    return ToolSupport(format_, bool(re.search(r"\btools\b", text)), bool(re.search(r"\btool_calls\b", text)))


def parse_tool_calls(format_: str, text: str) -> tuple[Optional[str], list[ParsedCall]]:
    """(content, calls) of a finished output in ``format_``; (text, []) when it holds no calls.
    Content is None when nothing but calls was written."""
    parser = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "mistral": _parse_mistral}.get(format_)
    if parser is None:
        raise ValueError(f"unknown tool-call format {format_!r} (one of {', '.join(FORMATS)})")
    parsed = parser(text)
    return parsed if parsed is not None else (text, [])


def _call(obj: Any, argument_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    """A call from a decoded {"name", "arguments"/"parameters"} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):          # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _content(pieces: list[str]) -> Optional[str]:
    text = "".join(pieces).strip()
    return text or None


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def _parse_hermes(text: str) -> Optional[tuple[Optional[str], list[ParsedCall]]]:
    calls, outside, at = [], [], 0
    for block in _HERMES_BLOCK.finditer(text):
        try:
            call = _call(json.loads(block.group(1)), ("arguments", "parameters"))
        except ValueError:
            return None
        if call is None:
            return None
        outside.append(text[at:block.start()])
        at = block.end()
        calls.append(call)
    if not calls:
        return None
    outside.append(text[at:])
    return _content(outside), calls


_LLAMA_SEPARATORS = " \t\r\n;"


def _parse_llama3_json(text: str) -> Optional[tuple[Optional[str], list[ParsedCall]]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        while at < len(body) and body[at] in _LLAMA_SEPARATORS:
            at += 1
    return None, calls


def _parse_mistral(text: str) -> Optional[tuple[Optional[str], list[ParsedCall]]]:
    marker = text.find("[TOOL_CALLS]")
    if marker >= 0:
        content, rest = text[:marker], text[marker + len("[TOOL_CALLS]"):].strip()
    else:                                   # the marker was a special token, skipped in the text
        content, rest = "", text.strip()
        if not rest.startswith("[{"):
            return None
    if rest.startswith("["):
        try:
            items, end = json.JSONDecoder().raw_decode(rest)
        except ValueError:
            return None
        calls = [_call(item, ("arguments", "parameters")) for item in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls) or rest[end:].strip():
            return None
        return _content([content]), calls
    return _parse_mistral_args(content, rest)


def _parse_mistral_args(content: str, rest: str) -> Optional[tuple[Optional[str], list[ParsedCall]]]:
    """v11+: ``name[ARGS]{...}``, each further call after another ``[TOOL_CALLS]``."""
    calls = []
    for part in rest.split("[TOOL_CALLS]"):
        name, sep, arguments = part.partition("[ARGS]")
        if not sep:
            return None
        try:
            obj, end = json.JSONDecoder().raw_decode(arguments.strip())
        except ValueError:
            return None
        call = _call({"name": name.strip(), "arguments": obj}, ("arguments",))
        if call is None or arguments.strip()[end:].strip():
            return None
        calls.append(call)
    return _content([content]), calls

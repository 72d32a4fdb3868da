"""A chat body as the model's chat template sees it: messages with string content, the tool
fields kept, and the tools to render.

- content: a string, or the text parts of an array joined (other parts are refused);
- an assistant message's ``tool_calls`` (arguments given to the template as an object, the
  Hugging Face convention templates are written for, when they are a JSON object), a tool
  message's ``tool_call_id``, a message's ``name`` reach the template;
- the deprecated forms become the current ones: an assistant ``function_call`` is a one-call
  ``tool_calls`` and the ``function`` message after it a ``tool`` message answering it;
- a template that never mentions ``tool_calls`` would drop them silently, so there an
  assistant message's calls are written into its content as JSON; a template that never
  mentions ``tools`` gets the tools listed in the system message instead.

``support`` is what the template does with tools (the engine's ``Tokenizer.tool_support``,
passed duck-typed: ``renders_tools``, ``renders_tool_calls``); None means it does everything.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from nightshift.jobs.batches.request_errors import RequestBodyError
from nightshift.jobs.batches.tool_calling import template_tools

TOOLS_IN_SYSTEM = ("You can call these functions. Each is given as JSON: its name, what it does, and the JSON "
                   "Schema of its arguments.")


def chat_prompt(body: dict[str, Any], support: Any = None) -> tuple[list[dict[str, Any]], Optional[list[dict]]]:
    """(messages, tools) for the chat template; tools None when there are none to pass."""
    messages = chat_messages(body, support)
    tools = template_tools(body)
    if tools and support is not None and not support.renders_tools:
        return _tools_in_system(messages, tools), None
    return messages, tools


def chat_messages(body: dict[str, Any], support: Any = None) -> list[dict[str, Any]]:
    """The messages for the template; RequestBodyError naming ``messages.<i>...`` for a bad one."""
    out: list[dict[str, Any]] = []
    answered: set[str] = set()              # ids of the tool calls made so far
    last_function_call: Optional[str] = None
    for i, msg in enumerate(body.get("messages") or []):
        role = msg["role"]
        message: dict[str, Any] = {"role": role, "content": _text(msg.get("content"), f"messages.{i}.content")}
        if isinstance(msg.get("name"), str):
            message["name"] = msg["name"]
        if role == "assistant" and msg.get("tool_calls") is not None:
            message["tool_calls"] = _history_calls(msg["tool_calls"], f"messages.{i}.tool_calls")
            answered.update(call["id"] for call in message["tool_calls"])
        elif role == "assistant" and msg.get("function_call") is not None:
            last_function_call = f"call_{i}"
            message["tool_calls"] = [_history_call({"id": last_function_call, "type": "function",
                                                    "function": msg["function_call"]}, f"messages.{i}.function_call")]
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise RequestBodyError(f"Missing required parameter: 'messages.{i}.tool_call_id'.",
                                       f"messages.{i}.tool_call_id", "missing_required_parameter")
            if call_id not in answered:
                raise RequestBodyError(f"Invalid parameter: messages with role 'tool' must be a response to a "
                                       f"preceding message with 'tool_calls' (no call has the id {call_id!r}).",
                                       f"messages.{i}.tool_call_id")
            message["tool_call_id"] = call_id
        elif role == "function":
            message["role"] = "tool"
            if last_function_call is not None:
                message["tool_call_id"] = last_function_call
        if "tool_calls" in message and support is not None and not support.renders_tool_calls:
            message["content"] = _calls_as_text(message["content"], message.pop("tool_calls"))
        out.append(message)
    return out


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestBodyError("Only text content parts are supported.", param)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestBodyError("'content' must be a string or an array of text parts.", param)


def _history_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestBodyError(f"'{param}' must be an array of tool calls.", param)
    return [_history_call(call, f"{param}.{j}") for j, call in enumerate(calls)]


def _history_call(call: Any, param: str) -> dict[str, Any]:
    """{"id", "type": "function", "function": {"name", "arguments"}}: arguments as an object
    when they are a JSON object (templates write them with ``| tojson``), else as sent."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(call.get("id"), str) or call.get("type", "function") != "function":
        raise RequestBodyError(f"'{param}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                               "\"arguments\"}}}.", param)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise RequestBodyError(f"'{param}.function.arguments' must be a string (JSON).", f"{param}.function.arguments")
    try:
        decoded = json.loads(arguments)
    except ValueError:
        decoded = None
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": decoded if isinstance(decoded, dict) else arguments}}


def _calls_as_text(content: str, calls: list[dict[str, Any]]) -> str:
    written = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
                         ensure_ascii=False)
    return f"{content}\n{written}" if content else written


def _tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    listed = TOOLS_IN_SYSTEM + "\n" + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{listed}" if first["content"] else listed
        return [first] + messages[1:]
    return [{"role": "system", "content": listed}] + messages

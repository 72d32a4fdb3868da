"""Function calling, as plain data: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (and the
deprecated ``functions`` / ``function_call``) checked and turned into a ``ToolPlan``; the grammar
of a forced call; the calls read back from a forced call's output.

How each ``tool_choice`` runs:

- ``none``: the tools are shown to the model (chat_history.py), it answers in text;
- ``auto`` (the default with tools): the model answers in its own tool-call format, which the
  worker parses (engine/tool_formats.py); a model whose chat template has no such format is
  refused (``unsupported_value`` naming ``tools``);
- a named function: a grammar forces the call; the output is the arguments object, checked
  against the function's ``parameters`` schema;
- ``required``: a grammar forces a JSON array (one call or more; exactly one when
  ``parallel_tool_calls`` is false) of ``{"name", "arguments"}`` objects, each the name of a
  tool and arguments following its schema;
- ``allowed_tools``: its ``mode`` (auto or required) over the listed tools only.

``functions`` runs as ``tools`` with ``parallel_tool_calls`` false, ``function_call`` as
``tool_choice``; the answer carries ``message.function_call`` instead of ``tool_calls``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from nightshift.jobs.batches.request_errors import RequestBodyError
from nightshift.jobs.batches.response_formats import (check_known_keys, check_name, check_optional,
                                                      check_schema_object)

MAX_TOOLS = 128                 # OpenAI's limit on tools (and functions)
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: Optional[dict[str, Any]]     # its JSON Schema; None: any object
    param: str                                # where the schema is in the body ("tools.2.function.parameters")


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                 # "none" | "auto" | "named" | "required"
    tools: tuple[FunctionTool, ...] = ()      # the functions the model may call (allowed_tools applied)
    named: Optional[FunctionTool] = None      # mode "named": the one it must call
    parallel: bool = True                     # False: at most one call
    legacy: bool = False                      # functions/function_call: answer with message.function_call
    field: str = "tools"                      # "tools" or "functions", as the body sent them

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")


NO_TOOLS = ToolPlan("none")


def tool_plan(body: dict[str, Any]) -> ToolPlan:
    """The body's tools and tool choice, checked as OpenAI checks them (errors name the field)."""
    tools, functions = body.get("tools"), body.get("functions")
    if functions is not None:
        if tools is not None:
            raise RequestBodyError("Send either 'tools' or the deprecated 'functions', not both.", "functions")
        return _legacy_plan(body)
    if body.get("function_call") is not None:
        raise RequestBodyError("'function_call' is only allowed when 'functions' are specified (with 'tools', "
                               "use 'tool_choice').", "function_call")
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None:
        for name, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise RequestBodyError(f"'{name}' is only allowed when 'tools' are specified.", name)
        return NO_TOOLS
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestBodyError("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    defined = _check_tools(tools)
    mode, named, callable_tools = _check_tool_choice(choice, defined)
    return ToolPlan(mode, callable_tools, named, parallel is not False)


def _check_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list) or not tools:
        raise RequestBodyError("'tools' must be a non-empty array of tools.", "tools")
    if len(tools) > MAX_TOOLS:
        raise RequestBodyError(f"'tools' has more than {MAX_TOOLS} tools ({len(tools)}).", "tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict):
            raise RequestBodyError(f"'{param}' must be an object.", param)
        kind = tool.get("type")
        if kind == "custom":
            raise RequestBodyError("Custom tools (free-form input) are not supported by this server; send "
                                   "function tools.", f"{param}.type", "unsupported_value")
        if kind is None:
            raise RequestBodyError(f"Missing required parameter: '{param}.type'.", f"{param}.type",
                                   "missing_required_parameter")
        if kind != "function":
            raise RequestBodyError(f"Invalid value for '{param}.type': {kind!r}. Supported values are: 'function'.",
                                   f"{param}.type", "invalid_value")
        check_known_keys(tool, ("type", "function"), param)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestBodyError(f"'{param}.function' must be an object with a 'name'.", f"{param}.function")
        out.append(_check_function(function, f"{param}.function", ("name", "description", "parameters", "strict")))
    _no_duplicates(out, "tools.{}.function.name")
    return tuple(out)


def _check_function(function: dict[str, Any], param: str, keys: tuple[str, ...]) -> FunctionTool:
    check_known_keys(function, keys, param)
    name = check_name(function.get("name"), f"{param}.name")
    check_optional(function, "description", str, param)
    check_optional(function, "strict", bool, param)
    parameters = function.get("parameters")
    if parameters is not None:
        check_schema_object(parameters, f"{param}.parameters")
        if parameters.get("type", "object") != "object":
            raise RequestBodyError(f"Invalid schema for function '{name}': the arguments must be a JSON Schema of "
                                   f"type 'object', got {parameters.get('type')!r}.", f"{param}.parameters")
    return FunctionTool(name, parameters, f"{param}.parameters")


def _no_duplicates(tools: tuple[FunctionTool, ...] | list[FunctionTool], param: str) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise RequestBodyError(f"Function names must be unique: {tool.name!r} is defined twice.",
                                   param.format(i))
        seen.add(tool.name)


def _check_tool_choice(choice: Any, tools: tuple[FunctionTool, ...]) \
        -> tuple[str, Optional[FunctionTool], tuple[FunctionTool, ...]]:
    if choice is None:
        return "auto", None, tools
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestBodyError(f"Invalid value for 'tool_choice': {choice!r}. Supported values are: 'none', "
                                   "'auto', 'required', or an object naming a function.", "tool_choice", "invalid_value")
        return choice, None, tools
    if not isinstance(choice, dict):
        raise RequestBodyError("'tool_choice' must be 'none', 'auto', 'required' or an object.", "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        check_known_keys(choice, ("type", "function"), "tool_choice")
        tool = _named(choice.get("function"), tools, "tool_choice.function")
        return "named", tool, tools
    if kind == "allowed_tools":
        check_known_keys(choice, ("type", "allowed_tools"), "tool_choice")
        return _allowed_tools(choice.get("allowed_tools"), tools)
    if kind == "custom":
        raise RequestBodyError("Custom tools are not supported by this server.", "tool_choice.type",
                               "unsupported_value")
    raise RequestBodyError(f"Invalid value for 'tool_choice.type': {kind!r}. Supported values are: 'function', "
                           "'allowed_tools'.", "tool_choice.type", "invalid_value")


def _named(function: Any, tools: tuple[FunctionTool, ...], param: str) -> FunctionTool:
    if not isinstance(function, dict):
        raise RequestBodyError(f"'{param}' must be an object with a 'name'.", param)
    check_known_keys(function, ("name",), param)
    name = function.get("name")
    if name is None:
        raise RequestBodyError(f"Missing required parameter: '{param}.name'.", f"{param}.name",
                               "missing_required_parameter")
    for tool in tools:
        if tool.name == name:
            return tool
    raise RequestBodyError(f"Invalid value for '{param}.name': no function named {name!r} is among the tools.",
                           f"{param}.name", "invalid_value")


def _allowed_tools(allowed: Any, tools: tuple[FunctionTool, ...]) \
        -> tuple[str, Optional[FunctionTool], tuple[FunctionTool, ...]]:
    param = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict):
        raise RequestBodyError(f"'{param}' must be an object with 'mode' and 'tools'.", param)
    check_known_keys(allowed, ("mode", "tools"), param)
    mode = allowed.get("mode")
    if mode not in ("auto", "required"):
        raise RequestBodyError(f"Invalid value for '{param}.mode': {mode!r}. Supported values are: 'auto', "
                               "'required'.", f"{param}.mode", "invalid_value")
    listed = allowed.get("tools")
    if not isinstance(listed, list) or not listed:
        raise RequestBodyError(f"'{param}.tools' must be a non-empty array of tools.", f"{param}.tools")
    names: set[str] = set()
    for i, entry in enumerate(listed):
        at = f"{param}.tools.{i}"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise RequestBodyError(f"'{at}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.", at)
        names.add(_named(entry.get("function"), tools, f"{at}.function").name)
    return mode, None, tuple(t for t in tools if t.name in names)


def _legacy_plan(body: dict[str, Any]) -> ToolPlan:
    for name in ("tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise RequestBodyError(f"'{name}' goes with 'tools'; with the deprecated 'functions', use "
                                   "'function_call'.", name)
    functions = body["functions"]
    if not isinstance(functions, list) or not functions:
        raise RequestBodyError("'functions' must be a non-empty array of functions.", "functions")
    if len(functions) > MAX_TOOLS:
        raise RequestBodyError(f"'functions' has more than {MAX_TOOLS} functions ({len(functions)}).", "functions")
    defined = []
    for i, function in enumerate(functions):
        if not isinstance(function, dict):
            raise RequestBodyError(f"'functions.{i}' must be an object with a 'name'.", f"functions.{i}")
        defined.append(_check_function(function, f"functions.{i}", ("name", "description", "parameters")))
    _no_duplicates(defined, "functions.{}.name")
    choice = body.get("function_call")
    if choice is None or choice in ("none", "auto"):
        return ToolPlan(choice or "auto", tuple(defined), None, False, True, "functions")
    if not isinstance(choice, dict):
        raise RequestBodyError(f"Invalid value for 'function_call': {choice!r}. Supported values are: 'none', "
                               "'auto', or an object naming a function.", "function_call", "invalid_value")
    named = _named(choice, tuple(defined), "function_call")
    return ToolPlan("named", tuple(defined), named, False, True, "functions")


def tool_grammar(plan: ToolPlan) -> Optional[dict[str, Any]]:
    """The grammar of a forced call ({"kind", "spec", "param"}), None when the model is free."""
    if plan.mode == "named":
        assert plan.named is not None
        return {"kind": "json_schema", "spec": plan.named.parameters or {"type": "object"},
                "param": plan.named.param}
    if plan.mode != "required":
        return None
    single = len(plan.tools) == 1
    items = [_call_schema(tool, "/items" if single else f"/items/anyOf/{i}") for i, tool in enumerate(plan.tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if single else {"anyOf": items}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return {"kind": "json_schema", "spec": schema, "param": plan.field}


def _call_schema(tool: FunctionTool, at: str) -> dict[str, Any]:
    """{"name": <the tool's name>, "arguments": <its schema>}, name first. The tool's own local
    references ("#/$defs/x", "#") are moved to where its schema now sits in the array's schema."""
    arguments = _relocated(tool.parameters, f"{at}/properties/arguments") if tool.parameters else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _relocated(schema: Any, base: str) -> Any:
    if isinstance(schema, dict):
        return {k: ("#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _relocated(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_relocated(v, base) for v in schema]
    return schema


_CALL_START = re.compile(r'\s*\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


def forced_calls(plan: ToolPlan, text: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in a forced call's output. A cut output (finish
    "length") gives what it holds: the calls written whole and, for the last, its name and the
    prefix of its arguments (a call cut before its name is left out)."""
    if plan.mode == "named":
        assert plan.named is not None
        return [(plan.named.name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return _cut_calls(text)
    return [(item["name"], _compact(item["arguments"])) for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item]


def _cut_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a JSON array cut short (the grammar wrote it compact: `[{"name":..,"arguments":..},..`)."""
    calls: list[tuple[str, str]] = []
    if not text.startswith("["):
        return calls
    decoder, at = json.JSONDecoder(), 1
    while at < len(text):
        try:
            item, end = decoder.raw_decode(text, at)
        except ValueError:
            start = _CALL_START.match(text, at)
            if start is not None:
                calls.append((json.loads(start.group(1)), text[start.end():]))
            return calls
        if isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item:
            calls.append((item["name"], _compact(item["arguments"])))
        at = end + 1 if text[end:end + 1] == "," else len(text)
    return calls


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def template_tools(body: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The tools to show the model, in OpenAI's shape (what chat templates expect): the body's
    function tools (or its deprecated functions), only the allowed ones under ``allowed_tools``.
    Lenient: ingest renders before the engine worker checks the body, and a line whose tools are
    malformed becomes an error line there, so here what is not a function tool is left out."""
    tools = body.get("tools")
    functions = body.get("functions")
    if tools is None and isinstance(functions, list):
        tools = [{"type": "function", "function": f} for f in functions]
    if not isinstance(tools, list):
        return None
    shown = [t for t in tools if isinstance(t, dict) and t.get("type") == "function"
             and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]
    allowed = _allowed_names(body.get("tool_choice"))
    if allowed is not None:
        shown = [t for t in shown if t["function"]["name"] in allowed]
    return shown or None


def _allowed_names(choice: Any) -> Optional[set[str]]:
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    listed = (choice.get("allowed_tools") or {}).get("tools") if isinstance(choice.get("allowed_tools"), dict) else None
    if not isinstance(listed, list):
        return None
    return {e["function"]["name"] for e in listed if isinstance(e, dict) and isinstance(e.get("function"), dict)
            and isinstance(e["function"].get("name"), str)}

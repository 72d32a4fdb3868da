"""Function calling as plain data (jobs/batches/tool_calling.py): tools and tool_choice checked as
OpenAI checks them, each tool_choice's grammar (run through llguidance on the default model's
vocabulary: what it accepts and refuses), and the calls read back from a forced call's output."""
from __future__ import annotations

import json

import pytest

from nightshift.jobs.batches.openai_mapping import CHAT, RequestBodyError, sampling_kwargs
from nightshift.jobs.batches.tool_calling import NO_TOOLS, forced_calls, tool_grammar, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
# pydantic writes nested models as $defs with references from the root: they must still resolve
# once the schema sits inside the array of calls
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": {
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
    "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                       "required": ["sku", "qty"]}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def kwargs(body, tool_format=None):
    return sampling_kwargs({"messages": MESSAGES, **body}, CHAT, 5, 2048, 256, 16, tool_format)


def refusal(body, tool_format=None) -> RequestBodyError:
    with pytest.raises(RequestBodyError) as e:
        kwargs(body, tool_format)
    return e.value


@pytest.fixture(scope="module")
def accepts():
    """accepts(grammar dict, text): whether llguidance's matcher for the grammar takes the text whole."""
    import llguidance

    from nightshift.engine import load_tokenizer

    tokenizer = load_tokenizer("default")
    ll = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                eos_token=tokenizer.eos_token_ids)
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}   # as engine/grammar.py

    def check(structured, text):
        assert structured["kind"] == "json_schema"
        grammar = llguidance.LLMatcher.grammar_from_json_schema(structured["spec"], overrides=compact)
        assert not llguidance.LLMatcher.validate_grammar(grammar, ll)
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()
    return check


def test_a_named_function_forces_its_arguments(accepts):
    structured = kwargs({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_weather"}}})["structured"]
    assert structured["param"] == "tools.0.function.parameters"
    assert accepts(structured, '{"city":"Paris","unit":"c"}') and accepts(structured, '{"city":"Oslo"}')
    assert not accepts(structured, '{"unit":"c"}') and not accepts(structured, '{"city":"Paris","wind":1}')
    # a function without parameters takes any object
    structured = kwargs({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_time"}}})["structured"]
    assert structured == {"kind": "json_schema", "spec": {"type": "object"}, "param": "tools.1.function.parameters"}


def test_required_forces_calls_of_the_listed_tools(accepts):
    structured = kwargs({"tools": [WEATHER, TIME, ORDER], "tool_choice": "required"})["structured"]
    assert structured["param"] == "tools"
    assert accepts(structured, '[{"name":"get_weather","arguments":{"city":"Paris"}}]')
    assert accepts(structured, '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"x"}}]')
    assert accepts(structured, '[{"name":"place_order","arguments":{"item":{"sku":"A1","qty":2}}}]')
    assert not accepts(structured, '[{"name":"place_order","arguments":{"item":{"sku":"A1"}}}]')   # $ref still holds
    assert not accepts(structured, '[]')
    assert not accepts(structured, '[{"name":"get_weather","arguments":{}}]')
    assert not accepts(structured, '[{"name":"send_email","arguments":{}}]')
    single = kwargs({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})["structured"]
    assert accepts(single, '[{"name":"get_time","arguments":{}}]')
    assert not accepts(single, '[{"name":"get_time","arguments":{}},{"name":"get_time","arguments":{}}]')
    one_tool = kwargs({"tools": [ORDER], "tool_choice": "required"})["structured"]
    assert accepts(one_tool, '[{"name":"place_order","arguments":{"item":{"sku":"B","qty":1}}}]')
    assert not accepts(one_tool, '[{"name":"place_order","arguments":{"item":{}}}]')


def test_allowed_tools_restrict_the_calls(accepts):
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    structured = kwargs({"tools": [WEATHER, TIME], "tool_choice": choice})["structured"]
    assert accepts(structured, '[{"name":"get_time","arguments":{}}]')
    assert not accepts(structured, '[{"name":"get_weather","arguments":{"city":"Paris"}}]')
    choice["allowed_tools"]["mode"] = "auto"
    plan = tool_plan({"tools": [WEATHER, TIME], "tool_choice": choice})
    assert plan.mode == "auto" and [t.name for t in plan.tools] == ["get_time"]


def test_auto_needs_a_chat_template_with_a_tool_call_format():
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        e = refusal(body)
        assert (e.code, e.param) == ("unsupported_value", "tools") and "no tool-call format" in e.message
        assert "'required'" in e.message
        assert kwargs(body, tool_format="hermes")["structured"] is None       # the model's own format, parsed later
    e = refusal({"tools": [WEATHER], "response_format": {"type": "json_object"}}, tool_format="hermes")
    assert (e.code, e.param) == ("unsupported_value", "response_format")
    # none: the model answers in text, response_format applies
    assert kwargs({"tools": [WEATHER], "tool_choice": "none", "response_format": {"type": "json_object"}})[
        "structured"]["kind"] == "json_object"
    # a forced call's grammar wins: response_format shapes content, and a forced call has none
    assert kwargs({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}})[
        "structured"]["param"] == "tools"


@pytest.mark.parametrize("body, param, code", [
    ({"tools": []}, "tools", "invalid_request"),
    ({"tools": {"type": "function"}}, "tools", "invalid_request"),
    ({"tools": [WEATHER] * 129}, "tools", "invalid_request"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools.0.type", "missing_required_parameter"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name",
     "missing_required_parameter"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "bad name!"}}]}, "tools.1.function.name",
     "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools.0.function.parameters", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools.0.function.strict",
     "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]}, "tools.0.function.returns",
     "unknown_parameter"),
    ({"tools": [TIME, TIME]}, "tools.1.function.name", "invalid_request"),
    ({"tools": [TIME], "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
     "missing_required_parameter"),
    ({"tools": [TIME], "tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice.type",
     "unsupported_value"),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}},
     "tool_choice.allowed_tools.mode", "invalid_value"),
    ({"tools": [TIME], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}}}, "tool_choice.allowed_tools.tools.0.function.name",
     "invalid_value"),
    ({"tools": [TIME], "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_request"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_request"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "invalid_request"),
    ({"function_call": "auto"}, "function_call", "invalid_request"),
    ({"tools": [TIME], "functions": [{"name": "f"}]}, "functions", "invalid_request"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name", "invalid_value"),
    ({"functions": [{"name": "f"}], "tool_choice": "none"}, "tool_choice", "invalid_request"),
    ({"functions": [{"name": "f", "strict": True}]}, "functions.0.strict", "unknown_parameter"),
])
def test_tool_shapes_are_checked_naming_the_field(body, param, code):
    e = refusal(body, tool_format="hermes")
    assert (e.param, e.code) == (param, code), e.message


def test_deprecated_functions_run_as_tools_without_parallel_calls():
    functions = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
    plan = tool_plan({"functions": functions, "function_call": {"name": "add"}})
    assert (plan.mode, plan.legacy, plan.parallel, plan.named.param) == ("named", True, False, "functions.0.parameters")
    assert tool_grammar(plan) == {"kind": "json_schema", "spec": functions[0]["parameters"],
                                  "param": "functions.0.parameters"}
    assert tool_plan({"functions": functions, "function_call": "none"}).mode == "none"
    e = refusal({"functions": functions})
    assert (e.param, e.code) == ("functions", "unsupported_value") and "function_call" in e.message
    assert tool_plan({}) is NO_TOOLS and tool_plan({"tools": [TIME], "tool_choice": "none"}).mode == "none"


def test_forced_calls_are_read_back_whole_or_cut():
    named = tool_plan({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert forced_calls(named, '{"city":"Paris"}') == [("get_weather", '{"city":"Paris"}')]
    assert forced_calls(named, '{"city":"Pa') == [("get_weather", '{"city":"Pa')]     # cut: a prefix
    required = tool_plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    whole = '[{"name":"get_weather","arguments":{"city":"Zürich"}},{"name":"get_time","arguments":{}}]'
    assert forced_calls(required, whole) == [("get_weather", '{"city":"Zürich"}'), ("get_time", "{}")]
    assert forced_calls(required, whole[:-2]) == [("get_weather", '{"city":"Zürich"}'), ("get_time", "{}")]
    assert forced_calls(required, whole[:-3]) == [("get_weather", '{"city":"Zürich"}'), ("get_time", "{")]
    assert forced_calls(required, whole[:-20]) == [("get_weather", '{"city":"Zürich"}')]      # the 2nd cut in its name
    assert forced_calls(required, '[{"name":"get_weather","arguments":{"ci') == [("get_weather", '{"ci')]
    assert forced_calls(required, '[{"name":"get_wea') == []                          # cut before its name
    assert forced_calls(required, '[{"name":"get_weather","arguments":{"city":"x"}},') == [
        ("get_weather", '{"city":"x"}')]
    assert json.loads(forced_calls(required, whole)[0][1]) == {"city": "Zürich"}

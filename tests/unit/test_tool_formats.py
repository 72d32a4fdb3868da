"""engine/tool_formats.py: the tool-call format read from a chat template's text, and finished
outputs (as models write them) parsed into content and calls."""
from __future__ import annotations

import json

import pytest

from nightshift.engine.tool_formats import ParsedCall, parse_tool_calls, tool_support

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN25_EXCERPT = ('{%- if tools %}{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
                  'query." }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{{- "For each function call, '
                  'return a json object with function name and arguments within <tool_call></tool_call> XML tags:'
                  '\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>" }}'
                  '{%- endif %}{%- for message in messages %}{%- for tool_call in message.tool_calls %}{%- endfor %}'
                  '{%- endfor %}')
LLAMA31_EXCERPT = ('{%- if tools is not none %}{{- "Given the following functions, please respond with a JSON for a '
                   'function call with its proper arguments that best answers the given prompt.\\n\\n" }}{{- \'Respond '
                   'in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
                   '{%- endif %}{%- if builtin_tools is defined %}{{- "<|python_tag|>" + tool_call.name }}{%- endif %}'
                   '{%- for tool_call in message.tool_calls %}{%- endfor %}')
MISTRAL_EXCERPT = ('{%- if tools is not none %}{{- "[AVAILABLE_TOOLS] [" }}{%- endif %}{%- for message in messages %}'
                   '{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- endif %}{%- endfor %}')


@pytest.mark.parametrize("template, expected", [
    (SMOLLM2, (None, False, False)),
    (QWEN25_EXCERPT, ("hermes", True, True)),
    (LLAMA31_EXCERPT, ("llama3_json", True, True)),
    (MISTRAL_EXCERPT, ("mistral", True, True)),
    (None, (None, False, False)),
])
def test_the_format_is_read_from_the_template(template, expected):
    support = tool_support(template)
    assert (support.format, support.renders_tools, support.renders_tool_calls) == expected


def args(**kw) -> str:
    return json.dumps(kw, separators=(",", ":"))


@pytest.mark.parametrize("text, content, calls", [
    # Qwen2.5: two parallel calls, as the model writes them
    ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
     '"date": "2024-10-01"}}\n</tool_call>', None,
     [ParsedCall("get_current_temperature", args(location="San Francisco, CA, USA")),
      ParsedCall("get_temperature_date", args(location="San Francisco, CA, USA", date="2024-10-01"))]),
    # text before the call is content; Hermes-2-Pro writes "arguments" first
    ('Let me look that up.\n<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
     '</tool_call>', "Let me look that up.", [ParsedCall("get_stock_fundamentals", args(symbol="TSLA"))]),
    # the closing tag never came (EOS right after the JSON)
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [ParsedCall("f", args(x=1))]),
    # arguments written as a JSON string; unicode kept
    ('<tool_call>{"name": "say", "arguments": "{\\"text\\": \\"héllo\\"}"}</tool_call>', None,
     [ParsedCall("say", '{"text":"héllo"}')]),
    # cut off inside the call: the text stands as written
    ('<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),
    ('No tools needed: 2 + 2 = 4.', 'No tools needed: 2 + 2 = 4.', []),
    ('<tool_call>\n{"not": "a call"}\n</tool_call>', '<tool_call>\n{"not": "a call"}\n</tool_call>', []),
])
def test_hermes_outputs(text, content, calls):
    assert parse_tool_calls("hermes", text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [ParsedCall("get_weather", args(city="Paris", unit="celsius"))]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [ParsedCall("get_weather", args(city="Paris"))]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1, 2]}}', None,
     [ParsedCall("a", "{}"), ParsedCall("b", args(k=[1, 2]))]),
    ('The capital of France is Paris.', 'The capital of France is Paris.', []),
    ('{"answer": 42}', '{"answer": 42}', []),                                  # JSON, but not a call
    ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
])
def test_llama3_json_outputs(text, content, calls):
    assert parse_tool_calls("llama3_json", text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
     None, [ParsedCall("get_current_weather", args(location="Paris, France", format="celsius"))]),
    # [TOOL_CALLS] is a special token: the engine's text skips it
    ('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', None,
     [ParsedCall("a", args(x=1)), ParsedCall("b", "{}")]),
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Checking.", [ParsedCall("get_weather", args(city="Paris"))]),
    ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"y": true}', None, [ParsedCall("a", "{}"), ParsedCall("b", args(y=True))]),
    ('It is sunny.', 'It is sunny.', []),
    ('[TOOL_CALLS] [{"name": "a", "arguments": {"x"', '[TOOL_CALLS] [{"name": "a", "arguments": {"x"', []),
])
def test_mistral_outputs(text, content, calls):
    assert parse_tool_calls("mistral", text) == (content, calls)


def test_an_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("nope", "text")

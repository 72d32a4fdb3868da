"""Chats with tools as the model's template sees them (jobs/batches/chat_history.py), rendered
at ingest through a real tokenizer and two real templates: Qwen2.5's, which renders tools,
tool calls and tool messages, and the default model's (SmolLM2), which knows none of them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import orjson
import pytest

from nightshift.engine.tokenizer import Tokenizer, load_tokenizer
from nightshift.jobs.batches.chat_history import TOOLS_IN_SYSTEM, chat_messages, chat_prompt
from nightshift.jobs.batches.ingest import tokenize_lines
from nightshift.jobs.batches.openai_mapping import CHAT, RequestBodyError, prompt_token_ids
from nightshift.jobs.batches.validation import validate_lines

# Qwen2.5-Instruct's chat template (tokenizer_config.json), as published
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]


@pytest.fixture(scope="module")
def smollm():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def qwen(smollm):
    """The default model's vocabulary (also ChatML) with Qwen2.5's template."""
    return Tokenizer(smollm.backend, QWEN25, smollm.special_tokens, smollm.eos_token_ids)


def test_tools_tool_calls_and_tool_messages_reach_a_template_that_renders_them(qwen):
    assert (qwen.tool_support.format, qwen.tool_support.renders_tools) == ("hermes", True)
    body = {"messages": HISTORY, "tools": [WEATHER, TIME]}
    messages, tools = chat_prompt(body, qwen.tool_support)
    assert tools == [WEATHER, TIME]
    text = qwen.render_chat(messages, tools=tools)
    assert '<tools>\n' + json.dumps(WEATHER, ensure_ascii=False) in text
    # the call's arguments are given as an object, so the template writes them as JSON, not as a quoted string
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_ingest_renders_tool_chats_with_the_full_template_and_plain_chats_fast(qwen):
    lines = [{"custom_id": "tools", "method": "POST", "url": CHAT,
              "body": {"model": "default", "messages": HISTORY, "tools": [WEATHER], "tool_choice": "auto"}},
             {"custom_id": "plain", "method": "POST", "url": CHAT,
              "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "allowed", "method": "POST", "url": CHAT,
              "body": {"model": "default", "messages": HISTORY[:2], "tools": [WEATHER, TIME], "tool_choice": {
                  "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                      {"type": "function", "function": {"name": "get_time"}}]}}}}]
    result = validate_lines([orjson.dumps(x) for x in lines], CHAT, {"default"}, max_lines=10, max_bytes=10**6)
    assert result.ok
    ids = tokenize_lines(result, CHAT, qwen, SimpleNamespace(max_batch_tokens=10**6))
    assert result.ok
    assert ids[0] == qwen.apply_chat_template(chat_messages(lines[0]["body"], qwen.tool_support), tools=[WEATHER])
    assert '"name": "get_weather"' in qwen.decode(ids[0], skip_special_tokens=False)
    assert ids[1] == qwen.apply_chat_template(lines[1]["body"]["messages"])
    allowed = qwen.decode(ids[2], skip_special_tokens=False)        # only the allowed tool is shown
    assert '"get_time"' in allowed and '"get_weather"' not in allowed.split("</tools>")[0]
    # the same ids on the path without the batch encoder
    assert prompt_token_ids(lines[0]["body"], CHAT, qwen) == ids[0]


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_in_the_content(smollm):
    assert (smollm.tool_support.format, smollm.tool_support.renders_tools,
            smollm.tool_support.renders_tool_calls) == (None, False, False)
    messages, tools = chat_prompt({"messages": HISTORY, "tools": [WEATHER]}, smollm.tool_support)
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n" + TOOLS_IN_SYSTEM)
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'}
    assert messages[3] == {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"}
    text = smollm.render_chat(messages)
    assert '<|im_start|>assistant\n[{"name": "get_weather"' in text and "<|im_start|>tool\n{\"celsius\": 21}" in text
    # no system message: one is added for the tools
    messages, _ = chat_prompt({"messages": HISTORY[1:2], "tools": [WEATHER]}, smollm.tool_support)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(TOOLS_IN_SYSTEM)


def test_deprecated_function_messages_become_tool_calls_and_tool_messages():
    body = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{\"a\": 2}"}},
                         {"role": "function", "name": "add", "content": "4"}],
            "functions": [{"name": "add", "parameters": {"type": "object"}}]}
    messages, tools = chat_prompt(body)
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "add", "arguments": {"a": 2}}}]
    assert messages[2] == {"role": "tool", "content": "4", "name": "add", "tool_call_id": "call_1"}
    assert tools == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "tool", "content": "x"}], "messages.0.tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}], "messages.0.tool_calls.0"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"x": 1}}}]}],
     "messages.0.tool_calls.0.function.arguments"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
])
def test_bad_tool_history_names_the_message(messages, param):
    with pytest.raises(RequestBodyError) as e:
        chat_messages({"messages": messages})
    assert e.value.param == param


def test_malformed_tools_are_left_out_at_ingest_and_refused_later():
    # ingest renders before the engine worker checks the body: a bad tool is not shown, the line fails there
    body = {"messages": HISTORY[1:2], "tools": [WEATHER, {"type": "custom", "custom": {"name": "x"}}, "junk"]}
    assert chat_prompt(body)[1] == [WEATHER]

"""The OpenAI fields through the real engine and the whole batch path (ingest, shard stream,
finalize): n choices, best_of, echo, a JSON schema, forced tool calls on the default model (whose
chat template has no tool-call format, so tool_choice auto is refused), refusals naming the field
(the engine's grammar refusal included). Bodies are parsed with the openai client's types."""
from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.service.test_logprobs import outputs
from tests.service.test_pipeline import CHAT, engine  # noqa: F401  (the session's engine)

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}


def chat(custom_id: str, **body) -> dict:
    base = {"model": "default", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {**base, **body}}


def test_chat_fields_through_the_engine(pg_db, settings_env, tmp_path, engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    lines = [
        chat("n3", n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
        chat("json", response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}),
        chat("named", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        chat("required", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
        chat("auto", tools=[WEATHER]),
        chat("unsupported_schema", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}),
        chat("unknown", guided_json={"type": "object"}),
    ]
    bodies = outputs(pg_db, get_object_store(), settings, engine, lines)

    n3 = ChatCompletion.model_validate(bodies["n3"])
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert n3.usage.completion_tokens == 18 and n3.usage.prompt_tokens == bodies["json"]["usage"]["prompt_tokens"]

    answer = ChatCompletion.model_validate(bodies["json"]).choices[0]
    assert answer.finish_reason == "stop"
    data = json.loads(answer.message.content)
    assert set(data) == {"city", "sunny"} and isinstance(data["sunny"], bool) and len(data["city"]) <= 12

    for custom_id in ("named", "required"):
        c = ChatCompletion.model_validate(bodies[custom_id]).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}

    assert (bodies["auto"]["error"]["code"], bodies["auto"]["error"]["param"]) == ("unsupported_value", "tools")
    refused = bodies["unsupported_schema"]["error"]
    assert refused["param"] == "response_format.json_schema.schema" and refused["message"]
    assert (bodies["unknown"]["error"]["code"], bodies["unknown"]["error"]["param"]) == ("unknown_parameter",
                                                                                          "guided_json")


def test_completions_best_of_and_echo_through_the_engine(pg_db, settings_env, tmp_path, engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")

    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"model": "default", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True,
                         **body}}

    bodies = outputs(pg_db, get_object_store(), settings, engine, [
        line("best", n=2, best_of=3, temperature=1.0, seed=11, logprobs=0), line("echo", echo=True, temperature=0),
        line("echo_logprobs", echo=True, logprobs=1)], "/v1/completions")
    best = Completion.model_validate(bodies["best"])
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 12   # all three ran
    sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert sums[0] >= sums[1]                                                                  # best first
    echo = Completion.model_validate(bodies["echo"]).choices[0]
    assert echo.text.startswith("Once upon a time") and len(echo.text) > len("Once upon a time")
    assert (bodies["echo_logprobs"]["error"]["code"], bodies["echo_logprobs"]["error"]["param"]) == (
        "unsupported_value", "echo")

"""End to end, production shape (the HTTP API, real Celery workers on Redis, Postgres, moto's S3
and the real default model), driven only through the official openai client: one batch that
mixes JSON-schema extraction (greedy and sampled), JSON objects, forced tool calls (a named
function and "required" over two tools), n=3 with penalties and logit bias, logprobs with
alternatives, and a schema the grammar library cannot compile. Every schema answer must parse
and validate: on a model as small as the default one that holds only if the token masks are
right. Every custom_id comes back once; the refused schema is an error line naming its field."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest
from openai.types.chat import ChatCompletion

from tests.engine.test_structured_output import PERSON, TEXTS as DOCUMENTS

from .api_fixtures import production_pipeline

pytestmark = pytest.mark.slow

REDIS_DB = 10   # apart from the other end-to-end tests' Redis databases
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def line(custom_id: str, user: str, **body) -> dict:
    base = {"model": "default", "max_tokens": 120, "temperature": 0,
            "messages": [{"role": "system", "content": "You extract facts into JSON and call tools when asked."},
                         {"role": "user", "content": user}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**base, **body}}


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def batch_lines() -> list[dict]:
    lines = []
    for i, doc in enumerate(DOCUMENTS):
        lines.append(line(f"extract-{i}", f"Extract the person:\n{doc}", response_format=schema_format(PERSON)))
        lines.append(line(f"sampled-{i}", f"Extract the person:\n{doc}", response_format=schema_format(PERSON),
                          temperature=0.9, seed=100 + i))
    lines.append(line("object-0", "Describe Paris as a JSON object with a name and a country.",
                      response_format={"type": "json_object"}, frequency_penalty=1.0))
    lines.append(line("object-1", "Give the population of Rome as a JSON object.",
                      response_format={"type": "json_object"}, frequency_penalty=1.0))
    lines.append(line("tool-named", "What is the weather in Lisbon, in celsius?", tools=[WEATHER, TIME],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    lines.append(line("tool-required", "What time is it in Oslo?", tools=[WEATHER, TIME], tool_choice="required"))
    lines.append(line("n3-penalties", "Write a short sentence about the sea.", n=3, temperature=1.0, seed=7,
                      max_tokens=12, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.1,
                      logit_bias={"28": -100}, logprobs=True, top_logprobs=3))
    lines.append(line("n2-schema", f"Extract the person:\n{DOCUMENTS[0]}", n=2, temperature=0.8, seed=3,
                      response_format=schema_format(PERSON)))
    lines.append(line("bad-schema", "Anything.", response_format=schema_format(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}, "bad")))
    return lines


@pytest.fixture
def pipeline(pg_url, s3_server, tmp_path):
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "structured") as running:
        yield running


def test_structured_batch_through_the_openai_client(pipeline):
    service, client = pipeline
    lines = batch_lines()
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    batch_file = client.files.create(file=("structured.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=batch_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.time() + 900
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"batch stuck in {batch.status}:\n{service.logs()}"
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.errors, service.log("worker-cpu"))
    assert batch.request_counts.model_dump() == {"total": len(lines), "completed": len(lines) - 1, "failed": 1}

    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines) and len(ids) == len(set(ids))
    bodies = {x["custom_id"]: ChatCompletion.model_validate(x["response"]["body"]) for x in output}

    for custom_id, body in bodies.items():
        if custom_id.startswith(("extract-", "sampled-", "n2-schema")):
            for choice in body.choices:
                assert choice.finish_reason == "stop", (custom_id, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len(bodies["n2-schema"].choices) == 2
    for custom_id in ("object-0", "object-1"):
        choice = bodies[custom_id].choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:    # cut at max_tokens: a prefix of an object, as OpenAI's is
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")

    named = bodies["tool-named"].choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS["get_weather"])
    required = bodies["tool-required"].choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for call in required.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])

    n3 = bodies["n3-penalties"]
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert n3.usage.completion_tokens == sum(len(c.logprobs.content) for c in n3.choices)
    for choice in n3.choices:
        for token in choice.logprobs.content:
            assert len(token.top_logprobs) == 3 and token.logprob <= 0
            assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
    assert batch.usage.output_tokens == sum(b.usage.completion_tokens for b in bodies.values())

    (refused,) = errors
    assert refused["custom_id"] == "bad-schema" and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["param"] == "response_format.json_schema.schema" and "look-around" in error["message"]

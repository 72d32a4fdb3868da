"""Every OpenAI request field honoured, refused, or ignored because it means nothing here, none
silently dropped (jobs/batches/request_fields.py, openai_mapping.sampling_kwargs); the README's
table is the code's."""
from __future__ import annotations

import re
from pathlib import Path
from typing import get_type_hints

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from nightshift.jobs.batches.openai_mapping import CHAT, COMPLETIONS, RequestBodyError, sampling_kwargs
from nightshift.jobs.batches.request_fields import FIELDS, HONOURED, IGNORED, REFUSED, fields_of, markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"
VLLM_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids"}
VLLM_ONLY = {CHAT: VLLM_EXTENSIONS, COMPLETIONS: VLLM_EXTENSIONS | {"response_format"}}   # vLLM's, not OpenAI's


def kwargs(body, endpoint=CHAT, tool_format=None):
    return sampling_kwargs(body, endpoint, 5, 2048, 256, 16, tool_format)


def refusal(body, endpoint=CHAT, tool_format=None) -> RequestBodyError:
    with pytest.raises(RequestBodyError) as e:
        kwargs(body, endpoint, tool_format)
    return e.value


def openai_fields(params) -> set[str]:
    # the streaming and non-streaming variants differ only by `stream`
    return set(get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("endpoint, params", [(CHAT, chat_params), (COMPLETIONS, completion_params)])
def test_the_table_has_every_openai_field_and_the_vllm_extensions(endpoint, params):
    assert set(fields_of(endpoint)) == openai_fields(params) | VLLM_ONLY[endpoint]
    assert {f.name for f in fields_of(endpoint).values() if f.vllm} == VLLM_ONLY[endpoint]
    assert {f.status for f in FIELDS} == {HONOURED, REFUSED, IGNORED}
    assert sum(endpoint in f.endpoints for f in FIELDS) == len(fields_of(endpoint))     # one row per field


def test_the_readme_table_is_the_codes():
    text = README.read_text()
    begin, end = "<!-- request-fields:begin -->", "<!-- request-fields:end -->"
    assert begin in text and end in text, "README.md lost the markers around the request-fields table"
    table = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == markdown_table(), "README's request-fields table differs from request_fields.FIELDS: " \
        "paste request_fields.markdown_table() between the markers"
    assert len(table.splitlines()) == len(FIELDS) + 2


@pytest.mark.parametrize("endpoint, name", [(CHAT, "frobnicate"), (CHAT, "echo"), (CHAT, "best_of"),
                                            (COMPLETIONS, "tools"), (COMPLETIONS, "messages"),
                                            (CHAT, "guided_json"), (COMPLETIONS, "top_logprobs")])
def test_a_field_in_neither_spec_is_refused_as_openai_refuses_it(endpoint, name):
    e = refusal({name: 1}, endpoint)
    assert (e.code, e.param, e.message) == ("unknown_parameter", name, f"Unrecognized request argument supplied: {name}")


@pytest.mark.parametrize("endpoint, body, param", [
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"prediction": {"type": "content", "content": "draft"}}, "prediction"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"verbosity": "high"}, "verbosity"),
    (COMPLETIONS, {"suffix": "}\n"}, "suffix"),
    (COMPLETIONS, {"echo": True, "logprobs": 0}, "echo"),
    (CHAT, {"tools": [{"type": "custom", "custom": {"name": "sql"}}]}, "tools.0.type"),
])
def test_refused_values_name_their_field(endpoint, body, param):
    e = refusal(body, endpoint)
    assert (e.code, e.param) == ("unsupported_value", param) and "not supported" in e.message


@pytest.mark.parametrize("body", [{"modalities": ["text"]}, {"verbosity": "medium"}, {"reasoning_effort": "none"},
                                  {"stream": False}, {"audio": None, "prediction": None, "stream_options": None}])
def test_values_that_change_nothing_are_accepted(body):
    assert kwargs(body) == kwargs({})


def test_stream_options_without_stream_is_refused_as_openai_refuses_it():
    e = refusal({"stream_options": {"include_usage": True}})
    assert e.param == "stream_options" and "only allowed when 'stream' is enabled" in e.message
    assert refusal({"stream": True}).code == "streaming_unsupported"


IGNORED_VALUES = {"metadata": {"team": "search"}, "store": True, "user": "u-1", "safety_identifier": "h" * 128,
                  "service_tier": "flex", "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit",
                                                                                          "ttl": "30m"},
                  "prompt_cache_retention": "24h"}


def test_ignored_fields_change_nothing_and_their_shape_is_checked():
    assert set(IGNORED_VALUES) == {f.name for f in FIELDS if f.status == IGNORED}
    assert kwargs(IGNORED_VALUES) == kwargs({})
    assert kwargs({"user": "u"}, COMPLETIONS) == kwargs({}, COMPLETIONS)
    for body, param in [({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
                        ({"metadata": {"k": 1}}, "metadata.k"), ({"store": "yes"}, "store"), ({"user": 5}, "user"),
                        ({"safety_identifier": "h" * 129}, "safety_identifier"),
                        ({"service_tier": "gold"}, "service_tier"),
                        ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
                        ({"prompt_cache_options": {"size": 1}}, "prompt_cache_options.size"),
                        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention")]:
        assert refusal(body).param == param


# Each honoured sampling field, set to a value other than its default, changes what the engine gets.
HONOURED_SAMPLING = [
    ({"max_completion_tokens": 9}, "max_tokens", 9), ({"max_tokens": 9}, "max_tokens", 9),
    ({"n": 3}, "n", 3), ({"stop": ["\n\n"]}, "stop", ["\n\n"]), ({"temperature": 0.2}, "temperature", 0.2),
    ({"top_p": 0.9}, "top_p", 0.9), ({"seed": 7}, "seed", 7), ({"frequency_penalty": 1.0}, "frequency_penalty", 1.0),
    ({"presence_penalty": -1.0}, "presence_penalty", -1.0), ({"logit_bias": {"11": -50}}, "logit_bias", {11: -50.0}),
    ({"logprobs": True}, "logprobs", True), ({"logprobs": True, "top_logprobs": 4}, "top_logprobs", 4),
    ({"top_k": 40}, "top_k", 40), ({"min_p": 0.05}, "min_p", 0.05), ({"repetition_penalty": 1.3}, "repetition_penalty", 1.3),
    ({"min_tokens": 3}, "min_tokens", 3), ({"ignore_eos": True}, "ignore_eos", True),
    ({"stop_token_ids": [2, 7]}, "stop_token_ids", [2, 7]),
    ({"response_format": {"type": "json_object"}}, "structured", {"kind": "json_object", "spec": None,
                                                                  "param": "response_format"}),
]


@pytest.mark.parametrize("body, key, value", HONOURED_SAMPLING)
def test_honoured_fields_reach_the_engine(body, key, value):
    assert kwargs(body)[key] == value and kwargs({})[key] != value


def test_completions_fields_reach_the_engine():
    kw = kwargs({"n": 2, "best_of": 5, "logprobs": 3}, COMPLETIONS)
    assert (kw["n"], kw["logprobs"], kw["top_logprobs"]) == (5, True, 3)     # best_of runs, n are returned
    kw = kwargs({"best_of": 4}, COMPLETIONS)
    assert (kw["n"], kw["logprobs"], kw["top_logprobs"]) == (4, True, 0)     # logprobs rank best_of's choices
    assert kwargs({"n": 2, "best_of": 2}, COMPLETIONS)["logprobs"] is False
    assert kwargs({"response_format": {"type": "json_object"}}, COMPLETIONS)["structured"]["kind"] == "json_object"
    assert kwargs({"echo": True}, COMPLETIONS) == kwargs({}, COMPLETIONS)   # echo shapes the answer only


def test_edges_openai_accepts():
    assert kwargs({"seed": -2**63})["seed"] == -2**63 and kwargs({"seed": 2**63 - 1})["seed"] == 2**63 - 1
    assert kwargs({"top_logprobs": 0})["top_logprobs"] == 0          # no alternatives asked: no logprobs needed
    assert kwargs({"stop": ""})["stop"] == []                        # an empty stop string stops nothing


def test_top_p_zero_keeps_the_most_likely_token():
    kw = kwargs({"top_p": 0})
    assert (kw["top_p"], kw["top_k"]) == (1.0, 1)


@pytest.mark.parametrize("endpoint, body, param, says", [
    (CHAT, {"n": 0}, "n", "between 1 and 128"), (CHAT, {"n": 129}, "n", "between 1 and 128"),
    (CHAT, {"n": 1.5}, "n", "integer"),
    (COMPLETIONS, {"n": 3, "best_of": 2}, "best_of", "greater than or equal to 'n'"),
    (COMPLETIONS, {"best_of": 21}, "best_of", "between 1 and 20"),
    (COMPLETIONS, {"echo": "yes"}, "echo", "boolean"),
    (CHAT, {"min_p": 1.5}, "min_p", "between 0 and 1"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    (CHAT, {"repetition_penalty": -1.2}, "repetition_penalty", "greater than 0"),
    (CHAT, {"repetition_penalty": "x"}, "repetition_penalty", "number"),
    (CHAT, {"min_tokens": -1}, "min_tokens", "between 0"),
    (CHAT, {"min_tokens": 10, "max_tokens": 5}, "min_tokens", "at most max_tokens (5)"),
    (CHAT, {"stop_token_ids": [1, -2]}, "stop_token_ids", "token ids"),
    (CHAT, {"stop_token_ids": 5}, "stop_token_ids", "token ids"),
    (CHAT, {"ignore_eos": 1}, "ignore_eos", "boolean"),
    (CHAT, {"top_k": -2}, "top_k", ">= -1"),
    (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    (CHAT, {"seed": 2**63}, "seed", "between"), (CHAT, {"seed": "1"}, "seed", "integer"),
    (CHAT, {"top_logprobs": 1}, "top_logprobs", "requires 'logprobs'"),
])
def test_bad_values_of_honoured_fields_name_them(endpoint, body, param, says):
    e = refusal(body, endpoint)
    assert e.param == param and says in e.message, e.message


@pytest.mark.parametrize("body, param, code", [
    ({"response_format": "json"}, "response_format", "invalid_request"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {}}, "response_format.type", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema", "invalid_request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "invalid_request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra", "unknown_parameter"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "unknown_parameter"),
])
def test_response_format_shape_errors_name_the_field(body, param, code):
    e = refusal(body)
    assert (e.param, e.code) == (param, code), e.message


@pytest.mark.parametrize("strict", [True, False, None])
def test_a_json_schema_is_enforced_strict_or_not(strict):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    spec = {"name": "reply", "schema": schema, "description": "The reply."}
    if strict is not None:
        spec["strict"] = strict
    assert kwargs({"response_format": {"type": "json_schema", "json_schema": spec}})["structured"] == {
        "kind": "json_schema", "spec": schema, "param": "response_format.json_schema.schema"}
    assert kwargs({"response_format": {"type": "text"}})["structured"] is None

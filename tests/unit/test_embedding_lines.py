"""/v1/embeddings lines: validation with line numbers and field paths, the four input forms,
planning estimates, the response shape, base64 vectors and the endpoint's prices."""
from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from nightshift.jobs.batches import embeddings
from nightshift.jobs.batches.ingest import plan_ingest, tokenize_lines
from nightshift.jobs.batches.openai_mapping import EMBEDDINGS
from nightshift.jobs.batches.validation import validate_lines
from nightshift.jobs.costs.accounting import prices_from_settings
from nightshift.settings import Settings

MODELS = {"default", "all-MiniLM-L6-v2"}


def line(custom_id="a", **body) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS,
                         "body": {"model": "default", "input": "hello", **body}})


def run(lines):
    return validate_lines(lines, EMBEDDINGS, MODELS, max_lines=100, max_bytes=10**6)


@pytest.mark.parametrize("value, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_the_four_input_forms(value, expected):
    assert embeddings.inputs({"input": value}) == expected


def test_valid_lines_pass_with_every_option():
    result = run([line("a"), line("b", input=["x", "y"], encoding_format="base64", dimensions=8, user="u"),
                  line("c", input=[[1, 2], [3]]), line("d", input=[5, 6])])
    assert [v.custom_id for v in result.lines] == ["a", "b", "c", "d"] and not result.errors
    assert run([line("a", model="all-MiniLM-L6-v2")]).model == "all-MiniLM-L6-v2"   # the served name


@pytest.mark.parametrize("body, code, param, message", [
    ({"input": None}, "invalid_request", "body.input", "Input parameter is required"),
    ({"input": ""}, "invalid_request", "body.input", "empty string"),
    ({"input": []}, "invalid_request", "body.input", "not empty"),
    ({"input": 3}, "invalid_request", "body.input", "must be a string"),
    ({"input": ["a", ""]}, "invalid_request", "body.input.1", "empty string"),
    ({"input": ["a", [1]]}, "invalid_request", "body.input.1", "mixes strings"),
    ({"input": [1, -2]}, "invalid_request", "body.input.1", "non-negative integers"),
    ({"input": [1, True]}, "invalid_request", "body.input.1", "non-negative integers"),
    ({"input": [[1], []]}, "invalid_request", "body.input.1", "non-empty array"),
    ({"input": ["a"] * 2049}, "invalid_request", "body.input", "at most 2048"),
    ({"encoding_format": "int8"}, "invalid_value", "body.encoding_format", "'float' and 'base64'"),
    ({"dimensions": 0}, "invalid_request", "body.dimensions", "positive integer"),
    ({"dimensions": "8"}, "invalid_request", "body.dimensions", "positive integer"),
    ({"user": 5}, "invalid_request", "body.user", "must be a string"),
    ({"model": "SmolLM2-135M-Instruct"}, "model_not_found", "body.model", "all-MiniLM-L6-v2"),
])
def test_bad_lines_name_their_line_and_field(body, code, param, message):
    raw = orjson.dumps({"custom_id": "bad", "method": "POST", "url": EMBEDDINGS,
                        "body": {"model": "default", "input": "hello", **body}})
    result = run([line("ok"), raw])
    (error,) = result.errors
    assert (error["code"], error["param"], error["line"]) == (code, param, 2)
    assert message in error["message"]
    assert [v.custom_id for v in result.lines] == ["ok"]


def test_a_chat_line_in_an_embeddings_batch_is_refused():
    raw = orjson.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}]}})
    errors = {(e["code"], e["param"], e["line"]) for e in run([raw]).errors}
    assert errors == {("invalid_url", "url", 1), ("invalid_request", "body.input", 1)}


def test_planning_estimates_and_the_token_limit():
    assert embeddings.planned_tokens({"input": [1, 2, 3]}) == 5
    assert embeddings.planned_tokens({"input": ["abcd" * 10, "x"]}) == 12 + 2
    assert embeddings.planned_tokens({"input": "word " * 10_000}) == embeddings.MAX_PLANNED_TOKENS_PER_INPUT
    settings = Settings(max_batch_tokens=1000, shard_token_budget=600, shard_max_requests=100, shard_min_count=1)
    result = run([line(str(i), input="word " * 400) for i in range(4)])     # 502 tokens each (estimated)
    token_ids = tokenize_lines(result, EMBEDDINGS, None, settings)
    assert token_ids == [[]] * 4
    (error,) = result.errors
    assert error["code"] == "token_limit_exceeded" and "2008 prompt tokens" in error["message"]
    plan = plan_ingest(run([line(str(i), input="word " * 400) for i in range(4)]), token_ids, EMBEDDINGS, settings)
    assert [s.members for s in plan.shards] == [[0], [1], [2], [3]]        # in file order, one per budget
    assert plan.max_tokens == [0] * 4 and [plan.prompt_length(i) for i in range(4)] == [502] * 4


def test_response_body_is_openais_shape():
    body = embeddings.response_body("m", [[0.5, 0.25], "AAAA"], 7)
    assert body == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]},
                             {"object": "embedding", "index": 1, "embedding": "AAAA"}]}


def test_vectors_are_floats_or_little_endian_float32_base64():
    from nightshift.workers.embedding_stream import encode_vector

    vector = np.array([0.1, -2.5, 3e-8], dtype=np.float32)
    encoded = encode_vector(vector, "base64")
    assert base64.b64decode(encoded) == vector.astype("<f4").tobytes()
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), "<f4"), vector)
    floats = encode_vector(vector, "float")
    assert isinstance(floats, list) and np.array_equal(np.array(floats, dtype=np.float32), vector)


def test_embeddings_are_priced_against_the_online_embedding_price():
    settings = Settings(online_embedding_usd_per_1m=0.02, online_input_usd_per_1m=0.15)
    assert prices_from_settings(settings, EMBEDDINGS).online_input_usd_per_1m == 0.02
    assert prices_from_settings(settings, EMBEDDINGS).online_output_usd_per_1m == 0.0
    assert prices_from_settings(settings, "/v1/chat/completions").online_input_usd_per_1m == 0.15

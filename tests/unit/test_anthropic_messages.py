"""Anthropic message batches as plain data: a create body's requests as pipeline lines, params
as engine inputs, the Message of a finish, pipeline result lines as Anthropic's, and the batch
object's counts (jobs/batches/anthropic_messages.py, anthropic_batches.py)."""
from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import pytest

from nightshift.jobs.batches import anthropic_batches as mb
from nightshift.jobs.batches.anthropic_messages import (MESSAGES, check_params, conversation, message_body,
                                                        prompt_token_ids, sampling_kwargs)
from nightshift.jobs.batches.progress import BatchProgress
from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.batches.request_errors import RequestBodyError

PARAMS = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


def convert(body) -> tuple[int, list[dict]]:  # noqa: ANN001
    out = io.BytesIO()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    count = mb.convert_requests(io.BytesIO(raw), out, max_requests=5)
    return count, [json.loads(line) for line in out.getvalue().splitlines()]


def test_create_body_becomes_pipeline_lines():
    count, lines = convert({"requests": [{"custom_id": "a-1", "params": PARAMS},
                                         {"custom_id": "B_2", "params": {**PARAMS, "temperature": 0.5}}]})
    assert count == 2
    assert lines == [{"custom_id": "a-1", "method": "POST", "url": MESSAGES, "body": PARAMS},
                     {"custom_id": "B_2", "method": "POST", "url": MESSAGES, "body": {**PARAMS, "temperature": 0.5}}]
    assert isinstance(lines[1]["body"]["temperature"], float)


@pytest.mark.parametrize("body, param, text", [
    ({"requests": []}, "requests", "at least 1"),
    ({}, "requests", "at least 1"),
    ({"requests": [{"custom_id": "x", "params": PARAMS}], "extra": 1}, "extra", "Extra inputs"),
    ({"requests": [{"custom_id": "has space", "params": PARAMS}]}, "requests.0.custom_id", "pattern"),
    ({"requests": [{"custom_id": "x" * 65, "params": PARAMS}]}, "requests.0.custom_id", "pattern"),
    ({"requests": [{"custom_id": "x", "params": PARAMS}, {"custom_id": "x", "params": PARAMS}]},
     "requests.1.custom_id", "unique"),
    ({"requests": [{"custom_id": "x"}]}, "requests.0.params", "Field required"),
    ({"requests": [{"custom_id": "x", "params": PARAMS, "foo": 1}]}, "requests.0.foo", "Extra inputs"),
    ({"requests": [{"custom_id": f"r{i}", "params": PARAMS} for i in range(6)]}, "requests", "at most 5"),
    ({"requests": [{"custom_id": "x", "params": {**PARAMS, "system": "a\u0000b"}}]}, "requests.0.params.system",
     "NUL"),
    ([1, 2], None, "JSON object"),
])
def test_what_anthropic_refuses_at_create_is_a_400_naming_the_field(body, param, text):
    with pytest.raises(InvalidInput) as err:
        convert(body)
    assert err.value.param == param and text in err.value.message, (err.value.param, err.value.message)


def test_a_body_that_is_not_json_is_refused():
    with pytest.raises(InvalidInput, match="not valid JSON"):
        convert(b'{"requests": [')


def test_params_become_the_template_prompt_and_sampling():
    params = {**PARAMS, "system": [{"type": "text", "text": "Be brief."}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text",
                                                                                          "text": "colour."}]},
                           {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Another?"},
                           {"role": "assistant", "content": "It is"}],
              "stop_sequences": ["\n\n", "END"], "temperature": 0.2, "top_k": 5, "metadata": {"user_id": "u1"}}
    messages, prefill = conversation(params)
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                        {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Another?"}]
    assert prefill == "It is"
    tokenizer = SimpleNamespace(apply_chat_template=lambda msgs, add_generation_prompt: [len(msgs), 99],
                                encode=lambda text: [ord(c) for c in text])
    assert prompt_token_ids(params, tokenizer) == [4, 99] + [ord(c) for c in "It is"]
    kwargs = sampling_kwargs(params, {"default"})
    assert kwargs == {"max_tokens": 8, "temperature": 0.2, "top_p": 1.0, "top_k": 5, "stop": ["\n\n", "END"], "n": 1}
    assert sampling_kwargs(PARAMS)["temperature"] == 1.0          # Anthropic's default


@pytest.mark.parametrize("change, param, code", [
    ({"model": "claude-x"}, "model", "model_not_found"),
    ({"max_tokens": None}, "max_tokens", "missing_required_parameter"),
    ({"max_tokens": 0}, "max_tokens", "invalid_request"),
    ({"temperature": 1.5}, "temperature", "invalid_request"),
    ({"top_k": -1}, "top_k", "invalid_request"),
    ({"messages": []}, "messages", "invalid_request"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages.0.role", "invalid_request"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages.1.role",
     "invalid_request"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type",
     "unsupported_value"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}]}, "messages.1.content",
     "invalid_request"),
    ({"tools": [{"name": "f"}]}, "tools", "unsupported_parameter"),
    ({"thinking": {"type": "enabled"}}, "thinking", "unsupported_parameter"),
    ({"stream": True}, "stream", "unsupported_parameter"),
    ({"frequency_penalty": 1}, "frequency_penalty", "invalid_request"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences", "invalid_request"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata", "invalid_request"),
])
def test_params_this_server_cannot_run_are_refused_by_name(change, param, code):
    params = {k: v for k, v in {**PARAMS, **change}.items() if v is not None}
    with pytest.raises(RequestBodyError) as err:
        check_params(params, {"default"})
    assert (err.value.param, err.value.code) == (param, code), err.value.message


def test_message_body_stop_reasons_and_usage():
    body = message_body("msg_1", "default", "Hello", "stop", None, 30, 20, 4)
    assert body["content"] == [{"type": "text", "text": "Hello"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    assert body["usage"] == {"input_tokens": 10, "output_tokens": 4, "cache_read_input_tokens": 20,
                             "cache_creation_input_tokens": 0, "service_tier": "batch"}
    assert message_body("m", "d", "x", "stop", "END", 1, 0, 1)["stop_reason"] == "stop_sequence"
    assert message_body("m", "d", "x", "stop", "END", 1, 0, 1)["stop_sequence"] == "END"
    assert message_body("m", "d", "x", "length", None, 1, 0, 1)["stop_reason"] == "max_tokens"


def test_pipeline_lines_become_anthropic_results():
    message = message_body("msg_1", "default", "Hi", "stop", None, 3, 0, 1)
    ok = {"custom_id": "a", "response": {"status_code": 200, "request_id": "req_1", "body": message}, "error": None}
    assert mb.result_line(ok) == {"custom_id": "a", "result": {"type": "succeeded", "message": message}}
    bad = {"custom_id": "b", "error": None, "response": {"status_code": 400, "request_id": "req_2", "body": {
        "error": {"message": "Extra inputs are not permitted.", "type": "invalid_request_error", "param": "foo",
                  "code": "invalid_request"}}}}
    assert mb.result_line(bad) == {"custom_id": "b", "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": "invalid_request_error", "message": "foo: Extra inputs are not permitted."},
        "request_id": "req_2"}}}
    cancelled = {"custom_id": "c", "response": None, "error": {"code": "batch_cancelled", "message": "x"}}
    expired = {"custom_id": "d", "response": None, "error": {"code": "batch_expired", "message": "x"}}
    failed = {"custom_id": "e", "response": None, "error": {"code": "model_unavailable", "message": "no model"}}
    assert mb.result_line(cancelled)["result"] == {"type": "canceled"}
    assert mb.result_line(expired)["result"] == {"type": "expired"}
    assert mb.result_line(failed)["result"]["error"]["error"] == {"type": "api_error", "message": "no model"}


def _batch(status: str, **times):  # noqa: ANN202
    now = time.time()
    fields = dict(id="msgbatch_1", status=status, created_at=now, expires_at=now + 86400, request_total=5,
                  cancelling_at=None, completed_at=None, failed_at=None, expired_at=None, cancelled_at=None,
                  output_file_id=None, error_file_id=None, errors=None)
    return SimpleNamespace(**{**fields, **times})


def test_batch_object_counts_processing_until_ended_then_by_outcome():
    url = "http://h/v1/messages/batches/msgbatch_1/results"
    running = mb.message_batch_document(_batch("in_progress"), BatchProgress(total=5, completed=2, failed=1), None, url)
    assert running["processing_status"] == "in_progress" and running["results_url"] is None
    assert running["request_counts"] == {"processing": 5, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    assert running["created_at"].endswith("Z") and running["ended_at"] is None
    assert mb.message_batch_document(_batch("cancelling", cancelling_at=1.0), BatchProgress(total=5), None,
                                     url)["processing_status"] == "canceling"
    ended = _batch("cancelled", cancelling_at=time.time(), cancelled_at=time.time(), output_file_id="f1",
                   error_file_id="f2")
    doc = mb.message_batch_document(ended, BatchProgress(total=5, completed=2, failed=3),
                                    {"canceled": 2, "expired": 0, "failed": 3}, url)
    assert doc["processing_status"] == "ended" and doc["results_url"] == url and doc["ended_at"]
    assert doc["request_counts"] == {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 2, "expired": 0}
    # cancelled before it ran: no result files, every request canceled
    early = mb.message_batch_document(_batch("cancelled", cancelled_at=time.time()), BatchProgress(total=5), {}, url)
    assert early["request_counts"] == {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 5, "expired": 0}
    failed = mb.message_batch_document(_batch("failed", failed_at=time.time()), BatchProgress(total=5), {}, url)
    assert failed["request_counts"]["errored"] == 5

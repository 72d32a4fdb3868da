"""Input a hostile user sends, against the running API (uvicorn, Postgres, moto S3): NUL and
control characters in ids, query values and JSON bodies, lone surrogates, bodies that are not
JSON objects, odd upload names. Each gets a 400 or 404 in OpenAI's error shape (never a 500 or
a dropped connection), naming the parameter."""
from __future__ import annotations

import json
import uuid
from urllib.parse import quote

import httpx
import pytest

from .api_fixtures import api_service, make_key  # noqa: F401
from .test_api_files import jsonl


@pytest.fixture
def http(api_service):  # noqa: F811
    key = make_key(api_service.db_url, f"hostile-{uuid.uuid4().hex[:8]}")   # a project of its own
    with httpx.Client(base_url=api_service.base_url, headers={"Authorization": f"Bearer {key}"},
                      timeout=30) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of an answer with this status (and the server still answers)."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert response.headers["x-should-retry"] == "false"
    assert httpx.get(str(response.request.url.copy_with(path="/health", query=None))).status_code == 200
    return body["error"]


def test_nul_in_the_input_file_id_of_a_new_batch_is_400(http):
    response = http.post("/batches", json={"input_file_id": "file-\u0000abc", "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("input_file_id", "invalid_value")
    assert "NUL" in error["message"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/batches/batch_%00x"),
    ("POST", "/batches/batch_%00x/cancel"),
    ("GET", "/files/file-%00x"),
    ("GET", "/files/file-%00x/content"),
    ("DELETE", "/files/file-%00x"),
    ("GET", "/batches/batch_%01x"),          # any control character: no such id can exist
])
def test_nul_or_control_character_in_a_path_id_is_404(http, method, path):
    error = error_of(http.request(method, path), 404)
    assert error["code"] == "not_found"
    assert "No batch found" in error["message"] or "No file found" in error["message"]


@pytest.mark.parametrize("path, param", [
    ("/batches?after=%00", "after"),
    ("/files?purpose=%00", "purpose"),
    ("/files?after=file-%00", "after"),
    ("/batches?limit=5&after=x%00y", "after"),
])
def test_nul_in_a_query_parameter_is_400_naming_it(http, path, param):
    error = error_of(http.get(path), 400)
    assert (error["param"], error["code"]) == (param, "invalid_value") and "NUL" in error["message"]


@pytest.mark.parametrize("metadata, param", [
    ({"team": "a\u0000b"}, "metadata.team"),
    ({"te\u0000am": "x"}, "metadata.te\\u0000am"),
])
def test_nul_anywhere_in_a_json_body_is_400_naming_the_field(http, metadata, param):
    file_id = http.post("/files", files={"file": ("in.jsonl", jsonl(1))}, data={"purpose": "batch"}).json()["id"]
    response = http.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h", "metadata": metadata})
    error = error_of(response, 400)
    assert error["param"] == param
    assert http.get("/batches").json()["data"] == []      # nothing was created


def test_lone_surrogate_in_a_json_body_is_400(http):
    raw = b'{"input_file_id": "file-\\ud800", "endpoint": "/v1/chat/completions", "completion_window": "24h"}'
    response = http.post("/batches", content=raw, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert error["param"] == "input_file_id" and "surrogate" in error["message"]


def test_body_that_is_not_json_names_no_parameter(http):
    response = http.post("/batches", content=b'{"input_file_id": ', headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == (None, "invalid_json")
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("raw, kind", [(b"[1, 2]", "an array"), (b'"file-x"', "a string"), (b"42", "a number")])
def test_body_that_is_not_a_json_object_says_what_it_is(http, raw, kind):
    response = http.post("/batches", content=raw, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == (None, "invalid_type")
    assert error["message"] == f"The request body must be a JSON object (got {kind})."


def test_missing_body_is_400(http):
    error = error_of(http.post("/batches"), 400)
    assert error["code"] == "missing_required_parameter" and "JSON object body" in error["message"]


def multipart(filename: bytes, content: bytes) -> tuple[bytes, str]:
    """A multipart upload body written by hand (clients escape odd bytes in names; a hostile one need not)."""
    boundary = "nightshift-hostile-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"").encode() + filename + \
        (f"\"\r\nContent-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("filename", ["a\u0000b.jsonl".encode(), b"x" * 600 + b".jsonl"])
def test_upload_name_that_cannot_be_stored_is_400(http, filename):
    body, content_type = multipart(filename, jsonl(1))
    response = http.post("/files", content=body, headers={"content-type": content_type})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("file", "invalid_value")
    assert http.get("/files").json()["data"] == []


@pytest.mark.parametrize("filename", ["日本語.jsonl", "résumé_😀.jsonl"])
def test_non_latin1_upload_name_is_served_back_with_rfc6266_disposition(http, filename):
    created = http.post("/files", files={"file": (filename, jsonl(1))}, data={"purpose": "batch"})
    assert created.status_code == 200, created.text
    assert created.json()["filename"] == filename
    content = http.get(f"/files/{created.json()['id']}/content")
    assert content.status_code == 200 and content.content == jsonl(1)
    disposition = content.headers["content-disposition"]
    assert f"filename*=UTF-8''{quote(filename, safe='')}" in disposition
    assert json.loads(http.get(f"/files/{created.json()['id']}").text)["filename"] == filename


def test_a_value_too_long_for_its_column_is_400_not_500(http):
    """A missed edge check is still the request's fault: the database's refusal (here a cron
    expression the parser accepts but the 120-character column cannot hold) answers 400."""
    body = {"name": "too-long-cron", "cron": "0," * 60 + "0 2 * * *", "timezone": "UTC",
            "endpoint": "/v1/chat/completions", "model": "default", "source": {"type": "prefix", "prefix": "docs/"},
            "prompt_template": {"messages": [{"role": "user", "content": "{{ document }}"}]}}
    error = error_of(http.post("/schedules", json=body), 400)
    assert error["code"] == "invalid_value" and "cannot be stored" in error["message"]
    assert "too long" in error["message"]

"""/v1/files through the official openai client against the running API (Postgres + moto S3)."""
from __future__ import annotations

import io
import json

import boto3
import botocore.exceptions
import httpx
import openai
import pytest

from .api_fixtures import api_service, project_client  # noqa: F401

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def jsonl(n: int) -> bytes:
    return b"".join(json.dumps({**LINE, "custom_id": f"r{i}"}).encode() + b"\n" for i in range(n))


def test_upload_retrieve_content_delete(api_service):  # noqa: F811
    client = project_client(api_service)
    data = jsonl(3)
    created = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose, created.status) == (len(data), "input.jsonl",
                                                                                  "batch", "processed")
    assert created.expires_at - created.created_at == 30 * 24 * 3600

    assert client.files.retrieve(created.id).model_dump() == created.model_dump()
    assert client.files.content(created.id).content == data

    s3 = boto3.client("s3", endpoint_url=api_service.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    assert s3.head_object(Bucket=api_service.bucket, Key=f"files/{created.id}")["ContentLength"] == len(data)
    deleted = client.files.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "file")
    with pytest.raises(openai.NotFoundError) as err:
        client.files.retrieve(created.id)
    assert err.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    assert created.id not in [f.id for f in client.files.list()]
    with pytest.raises(botocore.exceptions.ClientError):   # the content is gone from the store
        s3.head_object(Bucket=api_service.bucket, Key=f"files/{created.id}")


def test_expires_after_is_honoured(api_service):  # noqa: F811
    client = project_client(api_service)
    f = client.files.create(file=("x.jsonl", jsonl(1)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 7200})
    assert f.expires_at - f.created_at == 7200
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("x.jsonl", jsonl(1)), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 10})
    assert err.value.body["param"] == "expires_after.seconds"


@pytest.mark.parametrize("name, content, purpose, param, code", [
    ("empty.jsonl", b"", "batch", "file", "empty_file"),
    ("blank.jsonl", b" \n\t\r\n\n   ", "batch", "file", "empty_file"),   # whitespace only: as empty
    ("input.txt", jsonl(1), "batch", "file", "invalid_file_format"),
    ("input.jsonl", jsonl(1), "fine-tune", "purpose", "invalid_value"),
    ("big.jsonl", jsonl(51), "batch", "file", "too_many_lines"),            # limit 50 lines
    ("huge.jsonl", b"x" * (64 * 1024 + 1) + b"\n", "batch", "file", "file_too_large"),   # limit 64 KiB
])
def test_upload_refusals_name_the_problem(api_service, name, content, purpose, param, code):  # noqa: F811
    client = project_client(api_service)
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=(name, content), purpose=purpose)
    body = err.value.body
    assert (body["param"], body["code"], body["type"]) == (param, code, "invalid_request_error")
    assert err.value.response.headers["x-should-retry"] == "false"
    assert list(client.files.list()) == []   # nothing half-stored


def test_oversized_upload_refused_before_the_body_is_read(api_service):  # noqa: F811
    client = project_client(api_service)
    big = io.BytesIO(b"y" * (3 * 1024 * 1024))   # > limit + multipart slack: the middleware answers
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert err.value.body["code"] == "file_too_large"


def test_list_pages_with_after_and_order(api_service):  # noqa: F811
    client = project_client(api_service)
    ids = [client.files.create(file=(f"f{i}.jsonl", jsonl(1)), purpose="batch").id for i in range(5)]
    first = client.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more is True
    assert [f.id for f in first.data] == ids[::-1][:2]
    # iterating the page follows ?after=<last id> until has_more is false
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]
    assert [f.id for f in client.files.list(limit=2, order="asc")] == ids
    raw = httpx.get(f"{api_service.base_url}/files", params={"limit": 3, "after": ids[4]},
                    headers={"Authorization": f"Bearer {client.api_key}"}).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", ids[3], ids[1], True)
    assert [f.id for f in client.files.list(purpose="batch_output")] == []
    with pytest.raises(openai.BadRequestError) as err:
        client.files.list(limit=0)
    assert err.value.body["param"] == "limit"

"""End to end, production shape: the HTTP API (uvicorn), a cpu worker with beat and a gpu
worker (real Celery on real Redis), Postgres, moto's S3 server and the real default model,
driven only through the official openai client: upload, create, poll, download. The gpu worker
runs with a one-second stall watch, so its model load (longer than that) leaves every thread's
stack in its log (workers/stall_watch.py)."""
from __future__ import annotations

import json
import time

import pytest

from .api_fixtures import production_pipeline

REDIS_DB = 12   # apart from the other service tests' Redis database
SYSTEM = ("You are a terse assistant for the Nightshift batch test suite. Answer in one short sentence, "
          "without lists, without greetings, and never repeat the question back to the user.")


def batch_lines(n_ok: int) -> list[dict]:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"What is {i} plus {i}?"}]}}
             for i in range(n_ok)]
    # rejected by the model (prompt + max_tokens exceed the context): an error line, the rest completes
    lines.append({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "default", "max_tokens": 10_000_000,
                           "messages": [{"role": "user", "content": "hi"}]}})
    return lines


@pytest.fixture
def pipeline(pg_url, s3_server, tmp_path):
    # a watch shorter than any model load (0.6 s with warm caches on a 2-core Zen 5; a one-second
    # watch saw only the imports before it there), so the load's stack is in the log on any machine
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "e2e", engine_stall_seconds=0.1) as running:
        yield running


@pytest.mark.slow
def test_openai_client_round_trip(pipeline):
    service, client = pipeline
    lines = batch_lines(6)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    input_file = client.files.create(file=("e2e.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "e2e"})
    assert batch.status == "validating"

    deadline = time.time() + 600
    seen = set()
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"batch stuck in {batch.status}:\n{service.logs()}"
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
        seen.add(batch.status)
    assert batch.status == "completed", (batch.errors, service.log("worker-cpu"))
    assert "in_progress" in seen or "finalizing" in seen
    assert batch.request_counts.model_dump() == {"total": 7, "completed": 6, "failed": 1}
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.metadata == {"suite": "e2e"}
    gpu_log = (service.log_dir / "worker-gpu.log").read_text(errors="replace")
    assert "most recent call first" in gpu_log and "get_engine" in gpu_log   # the load, caught by the watch

    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output"
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]

    # every custom_id exactly once across the two files; output in input order
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines) and len(ids) == len(set(ids))
    assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(6)]
    for x in output:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        response = x["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] <= 6
    (rejected,) = errors
    assert rejected["custom_id"] == "too-long" and rejected["error"] is None
    assert rejected["response"]["status_code"] == 400
    assert rejected["response"]["body"]["error"]["code"] in ("context_length_exceeded", "invalid_request")

    # the batch is listed, and the input file is still retrievable
    assert batch.id in [b.id for b in client.batches.list()]
    assert client.files.content(input_file.id).content == data

    # retry only the failed line: a new batch of it, linked both ways, the original untouched
    import openai
    retry = client.post(f"/batches/{batch.id}/retry", body={"error_codes": [rejected["response"]["body"]["error"]["code"]]},
                        cast_to=openai.types.Batch)
    assert retry.status == "validating" and retry.metadata == {"retry_of": batch.id}
    assert [json.loads(x) for x in client.files.content(retry.input_file_id).text.splitlines()] == [lines[-1]]
    original = client.batches.retrieve(batch.id)
    assert original.metadata == {"suite": "e2e", "retried_by": retry.id}
    assert (original.output_file_id, original.error_file_id, original.request_counts) == \
        (batch.output_file_id, batch.error_file_id, batch.request_counts)
    while retry.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"retry stuck in {retry.status}"
        time.sleep(0.5)
        retry = client.batches.retrieve(retry.id)
    assert retry.request_counts.model_dump() == {"total": 1, "completed": 0, "failed": 1}
    with pytest.raises(openai.ConflictError, match="no failed requests with error code batch_expired"):
        client.post(f"/batches/{batch.id}/retry", body={"error_codes": ["batch_expired"]}, cast_to=openai.types.Batch)

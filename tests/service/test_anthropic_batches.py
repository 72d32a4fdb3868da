"""Anthropic's Message Batches API driven by the official ``anthropic`` client against the real
service: the API alone on Postgres + moto S3 (create, retrieve, list, cancel, delete, errors and
auth in Anthropic's shapes); the production shape (API, Celery workers on Redis, Postgres, S3,
the real default model) and the embedded default (``nightshift serve``) running batches to their
results, one invalid request among valid ones, every custom_id answered once, usage equal to the
cost report."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import anthropic
import httpx
import pytest

from .api_fixtures import (Service, api_service, free_port, make_key, production_pipeline,  # noqa: F401
                           service_env)


REDIS_DB = 15  # apart from the other service tests' Redis databases
PARAMS = {"model": "default", "max_tokens": 6, "temperature": 0,
          "messages": [{"role": "user", "content": "Say hello."}]}


def client_for(base_url: str, key: str, **kwargs) -> "anthropic.Anthropic":
    """The official client; base_url is the server's root (the client adds /v1/messages/...)."""
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=key, max_retries=0, **kwargs)


def requests_of(n: int, prefix: str = "r") -> list[dict]:
    return [{"custom_id": f"{prefix}-{i}", "params": {**PARAMS, "messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"}]}} for i in range(n)]


def wait_ended(client, batch_id: str, service, timeout: float = 600):  # noqa: ANN001, ANN201
    deadline = time.time() + timeout
    batch = client.messages.batches.retrieve(batch_id)
    while batch.processing_status != "ended":
        assert time.time() < deadline, f"{batch_id} stuck {batch.processing_status}:\n{service.logs()}"
        time.sleep(0.5)
        batch = client.messages.batches.retrieve(batch_id)
    return batch


# ---- the API alone ---------------------------------------------------------------------------

def test_create_retrieve_list_cancel_delete(api_service):  # noqa: F811
    key = make_key(api_service.db_url, f"anth-{uuid.uuid4().hex[:8]}")
    client = client_for(api_service.base_url, key)
    created = [client.messages.batches.create(requests=requests_of(3, f"b{i}")) for i in range(3)]
    batch = created[0]
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None and batch.ended_at is None
    assert batch.request_counts.model_dump() == {"processing": 3, "succeeded": 0, "errored": 0, "canceled": 0,
                                                 "expired": 0}
    assert (batch.expires_at - batch.created_at).total_seconds() == pytest.approx(86400, abs=1)
    assert client.messages.batches.retrieve(batch.id).model_dump() == batch.model_dump()

    newest_first = [b.id for b in reversed(created)]
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert (page.first_id, page.last_id) == (newest_first[0], newest_first[1])
    older = client.messages.batches.list(limit=2, after_id=page.last_id)
    assert [b.id for b in older.data] == newest_first[2:] and not older.has_more
    newer = client.messages.batches.list(limit=5, before_id=newest_first[2])
    assert [b.id for b in newer.data] == newest_first[:2]
    assert [b.id for b in client.messages.batches.list()] == newest_first      # the SDK's auto-paging

    canceling = client.messages.batches.cancel(created[1].id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    with pytest.raises(anthropic.ConflictError) as err:           # not ended: neither deleted nor readable
        client.messages.batches.delete(created[1].id)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        client.messages.batches.results(created[2].id)     # the SDK refuses: no results_url before the end
    raw = httpx.get(f"{api_service.base_url}/messages/batches/{created[2].id}/results", headers={"x-api-key": key})
    assert raw.status_code == 409 and raw.json()["type"] == "error"

    # the OpenAI face sees the same batch (one pipeline, two faces)
    same = httpx.get(f"{api_service.base_url}/batches/{batch.id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert same["endpoint"] == "/v1/messages" and same["status"] == "validating"


def test_bad_bodies_auth_and_other_projects_in_anthropic_shapes(api_service):  # noqa: F811
    key = make_key(api_service.db_url, f"anth-{uuid.uuid4().hex[:8]}")
    client = client_for(api_service.base_url, key)
    for requests, field in (([{"custom_id": "bad id", "params": PARAMS}], "requests.0.custom_id"),
                            (requests_of(1) + requests_of(1), "requests.1.custom_id"),
                            ([{"custom_id": "x", "params": "hi"}], "requests.0.params"),
                            ([], "requests")):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.batches.create(requests=requests)
        assert err.value.body["type"] == "error", err.value.body
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert err.value.body["error"]["message"].startswith(field), err.value.body
    with pytest.raises(anthropic.AuthenticationError) as err:
        client_for(api_service.base_url, "wrong-key").messages.batches.list()
    assert err.value.body["error"]["type"] == "authentication_error"
    missing = httpx.get(f"{api_service.base_url}/messages/batches")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    mine = client.messages.batches.create(requests=requests_of(1))
    other = client_for(api_service.base_url, make_key(api_service.db_url, f"other-{uuid.uuid4().hex[:8]}"))
    with pytest.raises(anthropic.NotFoundError) as err:
        other.messages.batches.retrieve(mine.id)
    assert err.value.body["error"]["type"] == "not_found_error"
    assert other.messages.batches.list().data == []
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_does_not_exist")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.batches.list(limit=5000)
    assert "limit" in err.value.body["error"]["message"]
    # an OpenAI batch is not a message batch
    assert httpx.get(f"{api_service.base_url}/messages/batches/batch_123", headers={"x-api-key": key}).status_code == 404


# ---- whole pipelines, the real model ----------------------------------------------------------

def _check_results(client, batch, valid: list[str], invalid: dict[str, str]) -> list:  # noqa: ANN001
    results = list(client.messages.batches.results(batch.id))
    ids = [r.custom_id for r in results]
    assert sorted(ids) == sorted(valid + list(invalid)) and len(ids) == len(set(ids))     # each exactly once
    by_id = {r.custom_id: r.result for r in results}
    for custom_id in valid:
        result = by_id[custom_id]
        assert result.type == "succeeded", result
        message = result.message
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.content[0].type == "text" and isinstance(message.content[0].text, str)
        assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert message.usage.output_tokens >= 1 and message.usage.input_tokens >= 0
    for custom_id, field in invalid.items():
        result = by_id[custom_id]
        assert result.type == "errored", result
        assert result.error.error.type == "invalid_request_error" and field in result.error.error.message
    return results


@pytest.mark.slow
def test_production_shape_runs_message_batches(pg_url, s3_server, tmp_path):
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "anth") as (service, openai_client):
        key = openai_client.api_key
        client = client_for(str(openai_client.base_url).rstrip("/"), key, timeout=60)
        requests = requests_of(4)
        requests[1]["params"]["system"] = [{"type": "text", "text": "You are terse."}]
        requests[2]["params"]["stop_sequences"] = [" "]
        requests[3]["params"]["messages"] = [{"role": "user", "content": "Count to five."},
                                             {"role": "assistant", "content": "One, two,"}]
        requests.append({"custom_id": "uses-tools", "params": {**PARAMS, "tools": [{"name": "f"}]}})
        requests.append({"custom_id": "other-model", "params": {**PARAMS, "model": "claude-nonexistent"}})
        batch = client.messages.batches.create(requests=requests)
        long_one = client.messages.batches.create(requests=[
            {"custom_id": f"long-{i}", "params": {**PARAMS, "max_tokens": 64}} for i in range(40)])
        cancelled = client.messages.batches.cancel(long_one.id)
        assert cancelled.processing_status in ("canceling", "ended")

        batch = wait_ended(client, batch.id, service)
        assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 4, "errored": 2, "canceled": 0,
                                                     "expired": 0}
        assert batch.ended_at is not None and batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
        results = _check_results(client, batch, [f"r-{i}" for i in range(4)],
                                 {"uses-tools": "tools", "other-model": "model"})
        by_id = {r.custom_id: r.result for r in results}
        stopped = by_id["r-2"].message
        assert stopped.stop_reason in ("stop_sequence", "max_tokens")
        if stopped.stop_reason == "stop_sequence":
            assert stopped.stop_sequence == " "

        # usage equals the cost report (the one report of the OpenAI face, same rows)
        report = httpx.get(f"{openai_client.base_url}batches/{batch.id}/cost",
                           headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        usages = [r.result.message.usage for r in results if r.result.type == "succeeded"]
        assert report["tokens"]["prompt_tokens"] == sum(u.input_tokens + u.cache_read_input_tokens for u in usages)
        assert report["tokens"]["cached_prompt_tokens"] == sum(u.cache_read_input_tokens for u in usages)
        assert report["tokens"]["completion_tokens"] == sum(u.output_tokens for u in usages)

        # retry of the failed lines (the OpenAI face's /retry) is a message batch again
        retried = httpx.post(f"{openai_client.base_url}batches/{batch.id}/retry",
                             headers={"Authorization": f"Bearer {key}"}, json={}, timeout=30).json()
        assert retried["id"].startswith("msgbatch_") and retried["metadata"] == {"retry_of": batch.id}, retried
        again = wait_ended(client, retried["id"], service)
        assert again.request_counts.errored == 2 and again.request_counts.succeeded == 0
        _check_results(client, again, [], {"uses-tools": "tools", "other-model": "model"})

        long_one = wait_ended(client, long_one.id, service)
        counts = long_one.request_counts
        assert counts.processing == 0 and counts.succeeded + counts.canceled == 40 and counts.errored == 0
        long_results = list(client.messages.batches.results(long_one.id))
        assert sorted(r.custom_id for r in long_results) == sorted(f"long-{i}" for i in range(40))
        assert sum(r.result.type == "canceled" for r in long_results) == counts.canceled

        deleted = client.messages.batches.delete(batch.id)
        assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
        with pytest.raises(anthropic.NotFoundError):
            client.messages.batches.retrieve(batch.id)


@pytest.mark.slow
def test_embedded_default_runs_message_batches(tmp_path):
    home = tmp_path / "home"
    port = free_port()
    service = Service(service_env(home, port=port), tmp_path)
    try:
        client = client_for(service.start_serve(port), (home / "api_key").read_text().strip(), timeout=60)
        batch = client.messages.batches.create(requests=requests_of(3) + [
            {"custom_id": "bad-temperature", "params": {**PARAMS, "temperature": 1.5}}])
        batch = wait_ended(client, batch.id, service)
        assert batch.request_counts.succeeded == 3 and batch.request_counts.errored == 1, service.logs()
        _check_results(client, batch, [f"r-{i}" for i in range(3)], {"bad-temperature": "temperature"})

        # the CLI's face of the same: a file of {"custom_id", "params"} lines becomes a message batch
        requests = tmp_path / "requests.jsonl"
        requests.write_text("".join(json.dumps(r) + "\n" for r in requests_of(2, "cli")))
        cli = [sys.executable, "-m", "nightshift.api.cli"]
        where = ["--base-url", f"http://127.0.0.1:{port}/v1"]
        submitted = subprocess.run(cli + ["submit", str(requests), "--wait", "--quiet"] + where, env=service.env,
                                   capture_output=True, text=True, timeout=600)
        assert submitted.returncode == 0, submitted.stderr
        batch_id = submitted.stdout.strip()
        assert batch_id.startswith("msgbatch_")
        status = subprocess.run(cli + ["status", batch_id, "--anthropic"] + where, env=service.env,
                                capture_output=True, text=True, timeout=60)
        assert json.loads(status.stdout)["request_counts"]["succeeded"] == 2, status.stderr
        results = subprocess.run(cli + ["results", batch_id, "--anthropic"] + where, env=service.env,
                                 capture_output=True, text=True, timeout=60)
        lines = [json.loads(line) for line in results.stdout.splitlines()]
        assert sorted(r["custom_id"] for r in lines) == ["cli-0", "cli-1"]
        assert all(r["result"]["type"] == "succeeded" for r in lines)
    finally:
        service.stop()

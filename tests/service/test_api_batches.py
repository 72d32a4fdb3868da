"""/v1/batches through the official openai client against the running API (no workers here:
batches stay where the API leaves them; the pipeline is exercised by test_e2e_openai.py)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from sqlalchemy import update

from nightshift.jobs.batches.models import Batch, Shard
from nightshift.storage.db import session_scope

from .api_fixtures import api_service, project_client  # noqa: F401
from .test_api_files import jsonl


def new_batch(client, **kwargs):  # noqa: ANN001, ANN003, ANN201
    f = client.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 **kwargs)


def test_create_and_retrieve(api_service):  # noqa: F811
    client = project_client(api_service)
    before = time.time()
    batch = new_batch(client, metadata={"team": "search"})
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert (batch.status, batch.endpoint, batch.completion_window) == ("validating", "/v1/chat/completions", "24h")
    assert batch.metadata == {"team": "search"}
    assert batch.created_at >= int(before) and batch.expires_at - batch.created_at in (86399, 86400)
    assert batch.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert batch.usage.total_tokens == 0 and batch.usage.input_tokens_details.cached_tokens == 0
    assert batch.output_file_id is None and batch.errors is None
    assert client.batches.retrieve(batch.id).id == batch.id


@pytest.mark.parametrize("kwargs, param, code", [
    ({"endpoint": "/v1/responses"}, "endpoint", "invalid_value"),
    ({"completion_window": "48h"}, "completion_window", "invalid_value"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"metadata": {"tags": 3}}, "metadata.tags", "invalid_value"),
    ({"input_file_id": None}, "input_file_id", "missing_required_parameter"),
])
def test_create_refusals_name_the_parameter(api_service, kwargs, param, code):  # noqa: F811
    client = project_client(api_service)
    f = client.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    body = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/batches", body=body, cast_to=openai.types.Batch)
    assert (err.value.body["param"], err.value.body["code"]) == (param, code)
    assert list(client.batches.list()) == []


def test_unknown_input_file_is_404(api_service):  # noqa: F811
    client = project_client(api_service)
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/completions", completion_window="24h")
    assert err.value.body["param"] == "input_file_id"


def test_list_pagination_newest_first(api_service):  # noqa: F811
    client = project_client(api_service)
    ids = [new_batch(client).id for _ in range(7)]
    page = client.batches.list(limit=3)
    assert [b.id for b in page.data] == ids[::-1][:3] and page.has_more is True
    assert [b.id for b in client.batches.list(limit=3)] == ids[::-1]   # auto-paging via ?after=
    last = client.batches.list(limit=3, after=ids[2])
    assert [b.id for b in last.data] == [ids[1], ids[0]] and last.has_more is False
    raw = httpx.get(f"{api_service.base_url}/batches", params={"limit": 100},
                    headers={"Authorization": f"Bearer {client.api_key}"}).json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", ids[-1], ids[0], False)
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)


def test_progress_counts_and_usage_come_from_shard_totals(api_service):  # noqa: F811
    client = project_client(api_service)
    batch = new_batch(client)
    now = time.time()
    with session_scope(api_service.db_url) as s:
        s.execute(update(Batch).where(Batch.id == batch.id).values(
            status="in_progress", in_progress_at=now - 10, request_total=10, planned_prompt_tokens=400,
            planned_max_tokens=100))
        s.add_all([Shard(batch_id=batch.id, seq=0, status="done", num_requests=6, completed_count=5,
                         failed_count=1, prompt_tokens=240, prefix_hit_tokens=160, completion_tokens=50),
                   Shard(batch_id=batch.id, seq=1, status="running", num_requests=4)])
    got = client.batches.retrieve(batch.id)
    assert got.status == "in_progress" and got.in_progress_at == int(now - 10)
    assert got.request_counts.model_dump() == {"total": 10, "completed": 5, "failed": 1}
    assert (got.usage.input_tokens, got.usage.input_tokens_details.cached_tokens, got.usage.output_tokens,
            got.usage.total_tokens) == (240, 160, 50, 290)
    progress = got.model_extra["progress"] if got.model_extra else got.progress  # extension field
    assert progress["requests_done"] == 6 and progress["fraction"] == pytest.approx(0.6)
    assert progress["tokens_done"] == 290 and progress["tokens_planned"] == 500
    assert progress["eta_seconds"] == pytest.approx(10 * 4 / 6, abs=1.0)
    listed = {b.id: b for b in client.batches.list()}
    assert listed[batch.id].request_counts.completed == 5


def test_cancel_rules(api_service):  # noqa: F811
    client = project_client(api_service)
    batch = new_batch(client)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert client.batches.cancel(batch.id).status == "cancelling"       # repeating is fine
    with session_scope(api_service.db_url) as s:
        s.execute(update(Batch).where(Batch.id == batch.id).values(status="cancelled", cancelled_at=time.time()))
    assert client.batches.cancel(batch.id).status == "cancelled"        # cancelling a cancelled one is fine

    done = new_batch(client)
    with session_scope(api_service.db_url) as s:
        s.execute(update(Batch).where(Batch.id == done.id).values(status="completed", completed_at=time.time()))
    with pytest.raises(openai.ConflictError) as err:
        client.batches.cancel(done.id)
    assert err.value.body["message"] == "Cannot cancel a batch with status 'completed'."
    assert err.value.response.headers["x-should-retry"] == "false"
    assert client.batches.retrieve(done.id).status == "completed"


def test_retry_needs_an_ended_batch_of_this_project(api_service):  # noqa: F811
    client = project_client(api_service)
    batch = new_batch(client)                       # no workers here: it stays validating
    with pytest.raises(openai.ConflictError) as err:
        client.post(f"/batches/{batch.id}/retry", body={}, cast_to=openai.types.Batch)
    assert err.value.body["code"] == "batch_not_ended" and "is validating" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        project_client(api_service).post(f"/batches/{batch.id}/retry", body={}, cast_to=openai.types.Batch)
    with pytest.raises(openai.BadRequestError) as err:
        client.post(f"/batches/{batch.id}/retry", body={"error_codes": []}, cast_to=openai.types.Batch)
    assert err.value.body["param"] == "error_codes"


def test_create_answers_even_when_the_broker_is_down(pg_url, s3_server, tmp_path):
    """The batch row is the truth; the ingest wake-up is re-sent by the reconciler later."""
    from .api_fixtures import Service, free_port, make_key, new_bucket, openai_client, s3_env, service_env

    dead_broker = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
    env = service_env(tmp_path, database_url=pg_url, broker_url=dead_broker,
                      **s3_env(s3_server, new_bucket(s3_server)))
    service = Service(env, tmp_path)
    try:
        client = openai_client(service.start_api(free_port()), make_key(pg_url, "broker-down"), timeout=60)
        batch = new_batch(client)
        assert client.batches.retrieve(batch.id).status == "validating"
        assert client.batches.cancel(batch.id).status == "cancelling"
    finally:
        service.stop()

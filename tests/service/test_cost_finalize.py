"""Cost files written by the real finalize, after a shard was re-run by a second worker:
the report counts every request exactly once and a repeated finalize changes nothing."""
from __future__ import annotations

import csv
import io
import math
import time

import orjson
import pytest
from sqlalchemy import select, update

from nightshift.jobs.batches.leases import RequestResult, claim_shard, complete_shard, pending_requests, write_results
from nightshift.jobs.batches.lifecycle import start_finalize_if_done
from nightshift.jobs.batches.models import Batch, Request, RequestStatus
from nightshift.jobs.batches.reconcile import reconcile
from nightshift.jobs.costs.batch_costs import cost_file_ids
from nightshift.jobs.files.models import File
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch
from tests.service.factories import in_transaction, make_running_batch


@pytest.fixture
def settings(any_db, settings_env, tmp_path):
    return settings_env(database_url=any_db, storage_dir=tmp_path / "objects", lease_seconds=30,
                        instance_usd_per_hour='{"cpu": 0.36, "cuda": 3.6}')


@pytest.fixture
def store(settings):
    from nightshift.storage.objectstore import get_object_store

    return get_object_store(settings)


def result(row_id: int, secs: float) -> RequestResult:
    return RequestResult(row_id, RequestStatus.COMPLETED, response_status_code=200,
                         response_body={"choices": [{"message": {"content": "ok"}}]}, finish_reason="stop",
                         prompt_tokens=10, cached_tokens=4, completion_tokens=5, engine_seconds=secs,
                         finished_at=time.time())


def read(store, db_url, file_id) -> bytes:  # noqa: ANN001
    with session_scope(db_url) as s:
        return b"".join(store.get_stream(s.get(File, file_id).object_key))


def test_rerun_shard_is_not_double_counted_and_finalize_is_idempotent(any_db, settings, store):
    bid, (shard_a, shard_b) = make_running_batch(any_db, store, 6, 2)
    # worker 1 answers two of shard A's three requests on the GPU, then dies
    lease1 = in_transaction(any_db, claim_shard, shard_a, "w1", lease_seconds=30, device="cuda:0")
    rows_a = in_transaction(any_db, pending_requests, lease1)
    in_transaction(any_db, write_results, lease1, [result(rows_a[0].id, 0.25), result(rows_a[1].id, 0.5)], 30,
                   device="cuda:0")
    in_transaction(any_db, reconcile, settings, now=time.time() + 60)
    # worker 2 re-runs shard A on a CPU: it answers all three, but only the unanswered one lands
    lease2 = in_transaction(any_db, claim_shard, shard_a, "w2", lease_seconds=30, device="cpu")
    assert in_transaction(any_db, write_results, lease2, [result(r.id, 9.0) for r in rows_a], 30, device="cpu") == 1
    assert in_transaction(any_db, complete_shard, lease2)
    lease3 = in_transaction(any_db, claim_shard, shard_b, "w2", lease_seconds=30, device="cpu")
    in_transaction(any_db, write_results, lease3,
                   [result(r.id, 1.0) for r in in_transaction(any_db, pending_requests, lease3)], 30, device="cpu")
    assert in_transaction(any_db, complete_shard, lease3)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"

    json_id, csv_id = cost_file_ids(bid)
    report = orjson.loads(read(store, any_db, json_id))
    with session_scope(any_db) as s:
        rows = s.scalars(select(Request).where(Request.batch_id == bid)).all()
        by_device = {r.custom_id: (r.device, r.engine_seconds) for r in rows}
    assert sorted(secs for _, secs in by_device.values()) == [0.25, 0.5, 1.0, 1.0, 1.0, 9.0]
    assert report["status"] == "completed"
    assert report["requests"] == {"total": 6, "completed": 6, "failed": 0}
    assert report["tokens"]["prompt_tokens"] == 60 and report["tokens"]["cached_prompt_tokens"] == 24
    assert report["tokens"]["completion_tokens"] == 30
    assert report["engine_seconds"] == 12.75
    expected_usd = math.fsum(secs * (3.6 if dev == "cuda:0" else 0.36) / 3600 for dev, secs in by_device.values())
    assert report["cost"]["usd"] == expected_usd
    assert {d["device"]: d["requests"] for d in report["by_device"]} == {"cpu": 4, "cuda:0": 2}
    rows_csv = list(csv.DictReader(io.StringIO(read(store, any_db, csv_id).decode())))
    assert [r["custom_id"] for r in rows_csv] == [f"req-{i}" for i in range(6)]
    assert math.fsum(float(r["cost_usd"]) for r in rows_csv) == report["cost"]["usd"]

    # finalize crashes after writing, before its status commit, and runs again: same files, same sums
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(status="finalizing"))
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"
    again = orjson.loads(read(store, any_db, json_id))
    for key in ("requests", "tokens", "engine_seconds", "cost", "by_device", "savings", "files"):
        assert again[key] == report[key]
    with session_scope(any_db) as s:
        assert s.query(File).filter(File.id.in_([json_id, csv_id])).count() == 2

"""Ingest that cannot succeed ends, on Postgres: a line Postgres cannot store (a NUL in its
custom_id or body) fails the batch with a line error naming the line and field; an ingest that
keeps raising (a tokenizer that cannot load) or whose attempts die fails the batch with
``ingest_failed`` after ``max_ingest_attempts``, and nothing sends it again."""
from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from nightshift.jobs.batches.ingest import start_ingest
from nightshift.jobs.batches.models import Batch, Request
from nightshift.jobs.batches.reconcile import reconcile
from nightshift.storage.db import session_scope
from nightshift.workers.ingest import ingest_batch
from tests.service.factories import in_transaction, make_batch, make_input_file, make_project
from tests.service.test_ingest import chat_line, tokenizer  # noqa: F401  (the session's tokenizer)

from .api_fixtures import Service, service_env

MISSING_MODEL = "/nonexistent/nightshift-test-model.gguf"


def batch_row(db_url: str, batch_id: str) -> Batch:
    with session_scope(db_url) as s:
        row = s.get(Batch, batch_id)
        s.expunge(row)
        return row


def cannot_load_tokenizer():  # noqa: ANN201 - the real loader, on a model file that is not there
    from nightshift.engine import load_tokenizer

    return load_tokenizer(MISSING_MODEL)


def test_nul_in_a_custom_id_or_body_fails_the_batch_with_line_errors(pg_db, settings_env, tmp_path,
                                                                     tokenizer):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    pid = make_project(pg_db)
    nul_body = chat_line(3)
    nul_body["body"]["messages"][1]["content"] = "before\u0000after"
    lines = [chat_line(0), {**chat_line(1), "custom_id": "abc\u0000def"}, chat_line(2), nul_body]
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, lines))
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).status == "failed"
    row = batch_row(pg_db, bid)
    assert row.status == "failed" and row.failed_at and row.ingest_attempts == 1
    errors = [(e["line"], e["code"], e["param"]) for e in row.errors["data"]]
    assert errors == [(2, "invalid_request", "custom_id"), (4, "invalid_request", "body.messages.1.content")]
    assert "NUL" in row.errors["data"][0]["message"]
    with session_scope(pg_db) as s:
        assert s.scalar(select(func.count()).select_from(Request).where(Request.batch_id == bid)) == 0


def test_an_ingest_that_keeps_raising_fails_the_batch_after_max_attempts(pg_db, settings_env, tmp_path):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o", max_ingest_attempts=3)
    store = get_object_store()
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, [chat_line(0)]))
    for attempt in (1, 2):   # retried: the task fails and the reconciler sends the ingest again
        with pytest.raises(FileNotFoundError):
            ingest_batch(bid, settings=settings, store=store, load_tokenizer=cannot_load_tokenizer)
        row = batch_row(pg_db, bid)
        assert (row.status, row.ingest_attempts) == ("validating", attempt)
    outcome = ingest_batch(bid, settings=settings, store=store, load_tokenizer=cannot_load_tokenizer)
    assert outcome.status == "failed"
    row = batch_row(pg_db, bid)
    assert (row.status, row.ingest_attempts) == ("failed", 3)
    (error,) = row.errors["data"]
    assert (error["code"], error["param"], error["line"]) == ("ingest_failed", None, None)
    assert "failed 3 times" in error["message"] and f"FileNotFoundError: model '{MISSING_MODEL}'" in error["message"]
    # no loop: the reconciler sends nothing for it, and a stray message changes nothing
    acts = in_transaction(pg_db, reconcile, settings, time.time() + 3600)
    assert bid not in acts.ingest
    assert ingest_batch(bid, settings=settings, store=store, load_tokenizer=cannot_load_tokenizer).status == "failed"
    assert batch_row(pg_db, bid).ingest_attempts == 3


def test_an_object_store_outage_does_not_use_up_the_attempts(pg_db, settings_env, tmp_path, tokenizer):  # noqa: F811
    """An unreachable store is not the batch's fault: however many attempts it interrupts, the
    batch is ingested once the store answers again."""
    from botocore.exceptions import EndpointConnectionError

    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o", max_ingest_attempts=2)
    store = get_object_store()
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, [chat_line(0), chat_line(1)]))

    class Unreachable:
        def __getattr__(self, name):  # noqa: ANN001, ANN204
            def fail(*_, **__):  # noqa: ANN002, ANN003, ANN202
                raise EndpointConnectionError(endpoint_url="http://s3.internal:9000")
            return fail

    for _ in range(4):                                     # twice the attempt limit
        with pytest.raises(EndpointConnectionError):
            ingest_batch(bid, tokenizer, settings=settings, store=Unreachable())
        row = batch_row(pg_db, bid)
        assert (row.status, row.ingest_attempts) == ("validating", 0)
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).status == "in_progress"
    assert batch_row(pg_db, bid).ingest_attempts == 1


def test_attempts_that_died_without_a_word_fail_the_batch(pg_db, settings_env, tmp_path, tokenizer):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o", max_ingest_attempts=2)
    store = get_object_store()
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, [chat_line(0)]))
    for _ in range(2):   # what a worker killed (OOM, SIGKILL) during ingest leaves: a counted attempt
        in_transaction(pg_db, start_ingest, bid, time.time())
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).status == "failed"
    (error,) = batch_row(pg_db, bid).errors["data"]
    assert error["code"] == "ingest_failed" and "failed 2 times" in error["message"]
    assert "stopped without reporting an error" in error["message"]


@pytest.mark.slow
def test_celery_ingest_with_a_model_that_cannot_load_ends_failed(pg_db, settings_env, tmp_path):
    """Real worker processes (cpu + upkeep with beat, the embedded broker): the task raises, the
    reconciler sends it again, and after max_ingest_attempts the batch is failed for good."""
    from nightshift.storage.objectstore import get_object_store

    conf = dict(database_url=pg_db, storage_dir=tmp_path / "objects", model=MISSING_MODEL, max_ingest_attempts=2,
                requeue_pending_after_seconds=1, reconcile_interval_seconds=0.5)
    settings = settings_env(**conf)
    store = get_object_store()
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, [chat_line(0)]))
    service = Service(service_env(tmp_path / "home", **conf), tmp_path)
    try:
        service.start_worker("cpu,upkeep", beat=True)
        deadline = time.monotonic() + 90
        while batch_row(pg_db, bid).status == "validating":
            assert time.monotonic() < deadline, service.log("worker-cpu,upkeep")
            time.sleep(0.5)
        time.sleep(4)   # several reconcile ticks later: still failed, no attempt added
        row = batch_row(pg_db, bid)
    finally:
        service.stop()
    assert (row.status, row.ingest_attempts) == ("failed", 2)
    assert row.errors["data"][0]["code"] == "ingest_failed"
    assert "FileNotFoundError" in row.errors["data"][0]["message"]
    log = (tmp_path / "worker-cpu,upkeep.log").read_text(errors="replace")
    assert "attempt 1 of 2; it will be retried" in log and "failed 2 times; failing the batch" in log

"""Expired files are garbage-collected on Postgres, from the local store and from S3 (moto's
server): the object removed and the row marked deleted; the input file of a batch that has not
ended and a schedule's source file are kept; a batch cannot be created on an expired file; the
upkeep worker's beat runs the removal on its own."""
from __future__ import annotations

import time

import openai
import pytest
from sqlalchemy import update

from nightshift.jobs.batches.models import Batch, BatchStatus
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.schedules.models import Schedule
from nightshift.storage.db import session_scope
from nightshift.workers.file_expiry import remove_expired_files
from tests.service.factories import make_batch, make_input_file, make_project

from .api_fixtures import Service, api_service, project_client, service_env  # noqa: F401
from .test_api_files import jsonl
from .test_storage import store  # noqa: F401  (local folder and moto S3)

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}]}}


def expire(db_url: str, file_id: str, at: float) -> None:
    with session_scope(db_url) as s:
        s.execute(update(File).where(File.id == file_id).values(expires_at=at))


def set_status(db_url: str, batch_id: str, status: str) -> None:
    with session_scope(db_url) as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(status=status))


def deleted_at(db_url: str, file_id: str):  # noqa: ANN201
    with session_scope(db_url) as s:
        return s.get(File, file_id).deleted_at


def test_expired_unused_files_are_removed_and_needed_ones_kept(pg_db, settings_env, store):  # noqa: F811
    settings = settings_env(database_url=pg_db)
    pid = make_project(pg_db)
    now = time.time()
    files = {name: make_input_file(pg_db, store, pid, [LINE])
             for name in ("unused", "running_input", "ended_input", "fresh", "schedule_source", "no_expiry")}
    for name in ("unused", "running_input", "ended_input", "schedule_source"):
        expire(pg_db, files[name], now - 60)
    expire(pg_db, files["fresh"], now + 3600)
    running = make_batch(pg_db, pid, files["running_input"])
    set_status(pg_db, running, BatchStatus.IN_PROGRESS)
    set_status(pg_db, make_batch(pg_db, pid, files["ended_input"]), BatchStatus.COMPLETED)
    with session_scope(pg_db) as s:
        s.add(Schedule(id=new_id("sched_"), project_id=pid, name="nightly", cron="0 3 * * *", endpoint=LINE["url"],
                       model="default", source={"type": "file", "file_id": files["schedule_source"]},
                       fire_after=now, next_due_at=now + 3600))

    assert remove_expired_files(settings, store, now=now) == 2
    gone = {name for name, fid in files.items() if not store.exists(f"files/{fid}")}
    assert gone == {"unused", "ended_input"}
    assert {name for name, fid in files.items() if deleted_at(pg_db, fid) is not None} == gone
    assert deleted_at(pg_db, files["unused"]) == pytest.approx(now)
    assert remove_expired_files(settings, store, now=now) == 0            # nothing left to do

    set_status(pg_db, running, BatchStatus.CANCELLED)                     # the batch ended: its input may go
    assert remove_expired_files(settings, store, now=now) == 1
    assert not store.exists(f"files/{files['running_input']}") and deleted_at(pg_db, files["running_input"])
    for name in ("fresh", "schedule_source", "no_expiry"):
        assert store.exists(f"files/{files[name]}") and deleted_at(pg_db, files[name]) is None


def test_a_pass_that_died_after_deleting_objects_is_finished_by_the_next(pg_db, settings_env, store):  # noqa: F811
    settings = settings_env(database_url=pg_db)
    pid = make_project(pg_db)
    ids = [make_input_file(pg_db, store, pid, [LINE]) for _ in range(5)]
    for fid in ids:
        expire(pg_db, fid, 1.0)
    store.delete(f"files/{ids[0]}")                  # its object went, then the pass died before the row
    assert remove_expired_files(settings, store, chunk=2) == 5              # chunked, and the gone one finished
    assert all(deleted_at(pg_db, fid) for fid in ids) and not any(store.exists(f"files/{f}") for f in ids)


def test_a_batch_cannot_be_created_on_an_expired_file(api_service):  # noqa: F811
    client = project_client(api_service)
    f = client.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    expire(api_service.db_url, f.id, time.time() - 1)
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (err.value.body["param"], err.value.body["code"]) == ("input_file_id", "file_expired")
    assert "upload it again" in err.value.body["message"]


@pytest.mark.slow
def test_the_upkeep_beat_removes_expired_files(pg_db, settings_env, tmp_path):
    from nightshift.storage.objectstore import get_object_store

    conf = dict(database_url=pg_db, storage_dir=tmp_path / "objects", expired_files_gc_interval_seconds=1)
    store = get_object_store(settings_env(**conf))
    pid = make_project(pg_db)
    expired, kept = make_input_file(pg_db, store, pid, [LINE]), make_input_file(pg_db, store, pid, [LINE])
    expire(pg_db, expired, time.time() - 1)
    service = Service(service_env(tmp_path / "home", **conf), tmp_path)
    try:
        service.start_worker("upkeep", beat=True)
        deadline = time.monotonic() + 60
        while deleted_at(pg_db, expired) is None:
            assert time.monotonic() < deadline, service.log("worker-upkeep")
            time.sleep(0.5)
    finally:
        service.stop()
    assert not store.exists(f"files/{expired}")
    assert store.exists(f"files/{kept}") and deleted_at(pg_db, kept) is None
    assert "expired files: removed 1" in service.log("worker-upkeep")

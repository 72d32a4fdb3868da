"""Scheduled incremental reindexing on real Postgres (+ SQLite) and an object store:
selection by content hash, the batch input, outputs under the index prefix, the manifest,
and idempotent start/publish."""
from __future__ import annotations

from datetime import datetime, timezone

import orjson
import pytest
from sqlalchemy import select

from nightshift.jobs.batches.models import Batch, BatchStatus, Request
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import Project
from nightshift.jobs.schedules.models import IndexedDocument, RunStatus, ScheduleRun
from nightshift.jobs.schedules.runs import finished_submitted_runs, publish_batch_results
from nightshift.jobs.schedules.service import create_schedule
from nightshift.storage.db import get_sessionmaker
from nightshift.storage.localdir import LocalDirStore
from nightshift.storage.objectstore import iter_lines
from nightshift.workers.schedule_runs import fire_due_schedules, schedule_tick, start_schedule_run

TEMPLATE = {"messages": [{"role": "user", "content": "Summarize {{ key }}:\n{{ document }}"}],
            "max_tokens": 8}


def ts(day, hour=2, minute=0) -> float:
    return datetime(2026, 11, day, hour, minute, tzinfo=timezone.utc).timestamp()


@pytest.fixture
def store(tmp_path):
    return LocalDirStore(tmp_path / "objects")


def setup_schedule(sm, store) -> str:
    for name, text in {"a.txt": "alpha", "b.txt": "bravo", "sub/c.txt": "charlie"}.items():
        store.put_stream(f"docs/{name}", text.encode())
    store.put_stream("elsewhere/x.txt", b"not in the source")
    with sm() as s, s.begin():
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
        s.flush()
        return create_schedule(s, project_id=pid, name="nightly", cron="0 2 * * *",
                               endpoint="/v1/chat/completions", model="default",
                               source={"type": "prefix", "prefix": "docs/"}, prompt_template=TEMPLATE,
                               index_prefix="index/nightly", metadata={"team": "search"},
                               now=ts(20, 12)).id


def fire_and_start(settings, store, now) -> tuple[str, str | None]:
    [run_id] = fire_due_schedules(settings, now)
    return run_id, start_schedule_run(settings, store, run_id, now=now)


def input_lines(sm, store, batch_id) -> list[dict]:
    with sm() as s:
        batch = s.get(Batch, batch_id)
        key = s.get(File, batch.input_file_id).object_key
    return [orjson.loads(line) for line in iter_lines(store.get_stream(key))]


def finish_batch(sm, batch_id, outcomes: dict[str, str], status=BatchStatus.COMPLETED):
    """Stand-in for the pipeline: one answered request row per input line, batch terminal."""
    with sm() as s, s.begin():
        for line, (custom_id, outcome) in enumerate(sorted(outcomes.items()), start=1):
            ok = outcome == "ok"
            s.add(Request(batch_id=batch_id, line=line, custom_id=custom_id, body={}, prompt_token_ids=[],
                          status="completed" if ok else "failed", response_status_code=200 if ok else 400,
                          response_body={"choices": [{"message": {"content": f"summary of {custom_id}"}}]}))
        s.get(Batch, batch_id).status = status


def run_row(sm, run_id) -> ScheduleRun:
    with sm() as s:
        return s.get(ScheduleRun, run_id)


def manifest(store) -> dict:
    return orjson.loads(b"".join(store.get_stream("index/nightly/_manifest.json")))


def test_incremental_reindex_over_four_nights(any_db, store, settings_env):
    settings = settings_env(database_url=any_db)
    sm = get_sessionmaker(any_db)
    sid = setup_schedule(sm, store)

    # night 1: everything is new
    run1, batch1 = fire_and_start(settings, store, ts(21))
    assert batch1 is not None
    assert start_schedule_run(settings, store, run1, now=ts(21)) is None        # duplicated start message: no-op
    lines = input_lines(sm, store, batch1)
    assert [l["custom_id"] for l in lines] == ["a.txt", "b.txt", "sub/c.txt"]
    assert lines[0]["url"] == "/v1/chat/completions"
    assert lines[0]["body"] == {"messages": [{"role": "user", "content": "Summarize a.txt:\nalpha"}],
                                "max_tokens": 8, "model": "default"}
    with sm() as s:
        batch = s.get(Batch, batch1)
        assert batch.status == BatchStatus.VALIDATING
        assert batch.metadata_ == {"team": "search", "schedule_id": sid, "schedule_run_id": run1}
        assert s.scalars(select(ScheduleRun.batch_id).where(ScheduleRun.id == run1)).one() == batch1
    finish_batch(sm, batch1, {"a.txt": "ok", "b.txt": "ok", "sub/c.txt": "ok"})
    with sm() as s, s.begin():
        assert finished_submitted_runs(s) == [batch1]
        assert publish_batch_results(s, store, batch1, now=ts(21, 3)) is True
    with sm() as s, s.begin():
        assert publish_batch_results(s, store, batch1, now=ts(21, 4)) is False   # once
    r1 = run_row(sm, run1)
    assert (r1.status, r1.documents_total, r1.documents_selected, r1.documents_indexed) == \
        (RunStatus.SUCCEEDED, 3, 3, 3)
    out = orjson.loads(b"".join(store.get_stream("index/nightly/sub/c.txt.json")))
    assert out["document"] == "sub/c.txt" and out["run_id"] == run1 and out["batch_id"] == batch1
    assert out["response"]["choices"][0]["message"]["content"] == "summary of sub/c.txt"
    m1 = manifest(store)
    assert sorted(m1["documents"]) == ["a.txt", "b.txt", "sub/c.txt"]
    assert m1["documents"]["a.txt"]["indexed_at"] == int(ts(21, 3))
    assert m1["last_run"]["id"] == run1 and m1["schedule_id"] == sid

    # night 2: b changed, d added, c deleted; d fails
    store.put_stream("docs/b.txt", b"bravo v2")
    store.put_stream("docs/d.txt", b"delta")
    store.delete("docs/sub/c.txt")
    run2, batch2 = fire_and_start(settings, store, ts(22))
    assert [l["custom_id"] for l in input_lines(sm, store, batch2)] == ["b.txt", "d.txt"]
    finish_batch(sm, batch2, {"b.txt": "ok", "d.txt": "error"})
    with sm() as s, s.begin():
        publish_batch_results(s, store, batch2, now=ts(22, 3))
    r2 = run_row(sm, run2)
    assert (r2.documents_selected, r2.documents_indexed, r2.documents_failed, r2.documents_removed) == (2, 1, 1, 1)
    assert not store.exists("index/nightly/sub/c.txt.json")
    m2 = manifest(store)
    assert sorted(m2["documents"]) == ["a.txt", "b.txt"]
    assert m2["documents"]["a.txt"]["run_id"] == run1          # unchanged: kept from night 1
    assert m2["documents"]["b.txt"]["run_id"] == run2          # replaced
    assert orjson.loads(b"".join(store.get_stream("index/nightly/b.txt.json")))["run_id"] == run2

    # night 3: nothing changed but d, which failed last time, is retried
    run3, batch3 = fire_and_start(settings, store, ts(23))
    assert [l["custom_id"] for l in input_lines(sm, store, batch3)] == ["d.txt"]
    finish_batch(sm, batch3, {"d.txt": "ok"})
    with sm() as s, s.begin():
        publish_batch_results(s, store, batch3, now=ts(23, 3))

    # night 4: nothing to do: no batch, run succeeds at once, manifest still complete
    run4, batch4 = fire_and_start(settings, store, ts(24))
    assert batch4 is None
    r4 = run_row(sm, run4)
    assert (r4.status, r4.documents_total, r4.documents_selected, r4.batch_id) == (RunStatus.SUCCEEDED, 3, 0, None)
    m4 = manifest(store)
    assert sorted(m4["documents"]) == ["a.txt", "b.txt", "d.txt"]
    assert m4["last_run"]["id"] == run4
    with sm() as s:
        assert s.scalars(select(IndexedDocument.doc_key).where(IndexedDocument.schedule_id == sid)
                         .order_by(IndexedDocument.doc_key)).all() == ["a.txt", "b.txt", "d.txt"]


def test_failed_batch_marks_run_failed_and_keeps_partial_results(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    setup_schedule(sm, store)
    run_id, batch_id = fire_and_start(settings, store, ts(21))
    finish_batch(sm, batch_id, {"a.txt": "ok", "b.txt": "error", "sub/c.txt": "error"},
                 status=BatchStatus.EXPIRED)
    with sm() as s, s.begin():
        publish_batch_results(s, store, batch_id, now=ts(21, 5))
    run = run_row(sm, run_id)
    assert run.status == RunStatus.FAILED and "expired" in run.error
    assert sorted(manifest(store)["documents"]) == ["a.txt"]


def test_bad_source_fails_the_run_with_a_clear_error(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    sid = setup_schedule(sm, store)
    store.put_stream("docs/big.txt", b"x" * 2048)
    settings = settings_env(max_file_bytes=1024)
    [run_id] = fire_due_schedules(settings, ts(21))
    assert start_schedule_run(settings, store, run_id, now=ts(21)) is None
    run = run_row(sm, run_id)
    assert run.status == RunStatus.FAILED and "docs/big.txt" in run.error
    assert run.batch_id is None


def test_stored_jsonl_file_source_is_incremental_by_line(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    lines = [orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "default", "messages": [{"role": "user", "content": f"hi {i}"}]}})
             for i in range(3)]
    store.put_stream("files/file-src", b"\n".join(lines) + b"\n")
    with sm() as s, s.begin():
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
        s.flush()
        s.add(File(id="file-src", project_id=pid, filename="q.jsonl", purpose="batch", bytes=1,
                   object_key="files/file-src"))
        s.flush()
        create_schedule(s, project_id=pid, name="replay", cron="0 2 * * *", endpoint="/v1/chat/completions",
                        model="default", source={"type": "file", "file_id": "file-src"},
                        index_prefix="index/nightly", now=ts(20, 12))
    run1, batch1 = fire_and_start(settings, store, ts(21))
    assert [orjson.dumps(l) for l in input_lines(sm, store, batch1)] == lines
    finish_batch(sm, batch1, {"q0": "ok", "q1": "ok", "q2": "ok"})
    with sm() as s, s.begin():
        publish_batch_results(s, store, batch1, now=ts(21, 3))
    run2, batch2 = fire_and_start(settings, store, ts(22))
    assert batch2 is None and run_row(sm, run2).documents_total == 3
    assert sorted(manifest(store)["documents"]) == ["q0", "q1", "q2"]


def test_too_many_changed_documents_fail_the_run_not_the_tick(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db, max_lines=2)
    sm = get_sessionmaker(pg_db)
    setup_schedule(sm, store)            # three documents, batches may hold two lines
    [run_id] = fire_due_schedules(settings, ts(21))
    assert start_schedule_run(settings, store, run_id, now=ts(21)) is None
    run = run_row(sm, run_id)
    assert run.status == RunStatus.FAILED and "2" in run.error and run.batch_id is None
    with sm() as s:
        assert s.scalars(select(File).where(File.purpose == "batch")).all() == []


def test_tick_restarts_lost_starts_and_publishes_unpublished_batches(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db, schedule_start_retry_seconds=120)
    sm = get_sessionmaker(pg_db)
    setup_schedule(sm, store)
    first = schedule_tick(settings, store, now=ts(21))
    assert len(first.fired) == 1 and first.restart == [] and first.published == []
    run_id = first.fired[0]
    # the start message was lost: a later tick asks for it again, an early one does not
    assert schedule_tick(settings, store, now=ts(21) + 60).restart == []
    assert schedule_tick(settings, store, now=ts(21) + 180).restart == [run_id]
    batch_id = start_schedule_run(settings, store, run_id, now=ts(21) + 180)
    # the batch finished but its finalize hook never published (e.g. finalize from an old worker)
    finish_batch(sm, batch_id, {"a.txt": "ok", "b.txt": "ok", "sub/c.txt": "ok"})
    tick = schedule_tick(settings, store, now=ts(21, 4))
    assert tick.published == [batch_id] and tick.fired == [] and tick.restart == []
    assert run_row(sm, run_id).status == RunStatus.SUCCEEDED
    assert schedule_tick(settings, store, now=ts(21, 5)).published == []


def test_run_whose_batch_was_deleted_does_not_block_its_schedule(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    setup_schedule(sm, store)
    run_id, batch_id = fire_and_start(settings, store, ts(21))
    with sm() as s, s.begin():
        s.delete(s.get(Batch, batch_id))
    tick = schedule_tick(settings, store, now=ts(22))
    assert run_row(sm, run_id).status == RunStatus.FAILED and "deleted" in run_row(sm, run_id).error
    assert len(tick.fired) == 1   # the next night is not skipped as "previous run still active"


def _request(custom_id: str, text: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "default", "messages": [{"role": "user", "content": text}]}})


def _jsonl_schedule(sm, store, name="lines") -> str:
    with sm() as s, s.begin():
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
        s.flush()
        return create_schedule(s, project_id=pid, name=name, cron="0 2 * * *", endpoint="/v1/chat/completions",
                               model="default", source={"type": "prefix", "prefix": "queue/", "format": "jsonl"},
                               index_prefix="index/nightly", now=ts(20, 12)).id


def test_jsonl_prefix_source_lines_are_documents(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    store.put_stream("queue/a.jsonl", _request("q1", "one") + b"\n" + _request("q2", "two") + b"\n")
    store.put_stream("queue/sub/b.jsonl", _request("q3", "three") + b"\n")
    store.put_stream("queue/readme.txt", b"not a request file")
    _jsonl_schedule(sm, store)
    run1, batch1 = fire_and_start(settings, store, ts(21))
    assert [l["custom_id"] for l in input_lines(sm, store, batch1)] == ["q1", "q2", "q3"]
    finish_batch(sm, batch1, {"q1": "ok", "q2": "ok", "q3": "ok"})
    with sm() as s, s.begin():
        publish_batch_results(s, store, batch1, now=ts(21, 3))
    # q2's request changed, q3's file is gone: only q2 is sent, q3's output is removed
    store.put_stream("queue/a.jsonl", _request("q1", "one") + b"\n" + _request("q2", "two, edited") + b"\n")
    store.delete("queue/sub/b.jsonl")
    run2, batch2 = fire_and_start(settings, store, ts(22))
    assert [l["body"]["messages"][0]["content"] for l in input_lines(sm, store, batch2)] == ["two, edited"]
    assert run_row(sm, run2).removed == ["q3"]


def test_jsonl_prefix_duplicate_custom_id_fails_the_run_naming_both(pg_db, store, settings_env):
    settings = settings_env(database_url=pg_db)
    sm = get_sessionmaker(pg_db)
    store.put_stream("queue/a.jsonl", _request("q1", "one") + b"\n")
    store.put_stream("queue/b.jsonl", b"\n" + _request("q1", "again") + b"\n")
    _jsonl_schedule(sm, store)
    [run_id] = fire_due_schedules(settings, ts(21))
    assert start_schedule_run(settings, store, run_id, now=ts(21)) is None
    error = run_row(sm, run_id).error
    assert "queue/b.jsonl line 2" in error and "queue/a.jsonl line 1" in error

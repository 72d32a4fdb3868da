"""An engine worker's shard stream with the real engine: one run takes further shards ahead and
keeps the engine full across them, each result written once under its own shard's lease;
only shards nobody else picked up are taken; a lost lease stops that shard alone; a failing
engine hands every held shard back."""
from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select

from nightshift.jobs.batches.lifecycle import cancel_now, request_cancel
from nightshift.jobs.batches.models import Request, Shard
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from nightshift.workers.shard_stream import run_shard
from tests.service.factories import make_batch, make_input_file, make_project
from tests.service.test_pipeline import engine, line  # noqa: F401  (the session's engine fixture)

pytestmark = pytest.mark.slow


def ingested(db_url, store, settings, engine, lines):  # noqa: ANN001, ANN201, F811
    pid = make_project(db_url)
    bid = make_batch(db_url, pid, make_input_file(db_url, store, pid, lines))
    outcome = ingest_batch(bid, engine.tokenizer, settings=settings, store=store)
    assert outcome.status == "in_progress"
    return bid, outcome.shard_ids


def rows_of(db_url, bid):  # noqa: ANN001, ANN201
    with session_scope(db_url) as s:
        return s.scalars(select(Request).where(Request.batch_id == bid).order_by(Request.line)).all()


def shards_of(db_url, bid):  # noqa: ANN001, ANN201
    with session_scope(db_url) as s:
        return s.scalars(select(Shard).where(Shard.batch_id == bid).order_by(Shard.seq)).all()


def test_one_run_streams_every_waiting_shard_through_one_engine(any_db, settings_env, tmp_path, engine,  # noqa: F811
                                                                 caplog):
    import logging
    import re

    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", shard_max_requests=3,
                            claim_ahead_after_seconds=0, result_flush_rows=4)
    store = get_object_store()
    bid, shard_ids = ingested(any_db, store, settings, engine, [line(i) for i in range(10)])
    assert len(shard_ids) == 4                                 # 3 + 3 + 3 + 1 requests
    finalized = []
    listeners = list(engine.step_listeners)
    with caplog.at_level(logging.INFO, logger="nightshift.workers.shard_stream"):
        run = run_shard(shard_ids[0], engine, settings=settings, owner="w1", device="cpu",
                        on_finalize=finalized.append)
    assert run.status == "done" and sorted(run.shards_done) == sorted(shard_ids)
    # the stream's timing line splits generate into the engine's steps and the rest; its step counter is gone
    timing = dict(re.findall(r"(\w+)=([\d.]+)", next(r.getMessage() for r in caplog.records
                                                    if r.getMessage().startswith("timing stream="))))
    assert int(timing["steps"]) > 0 and 0 < float(timing["step_seconds"]) <= float(timing["generate"])
    assert engine.step_listeners == listeners
    assert run.results_written == 10 and run.finalize == finalized == [bid]
    # the other shards' own wake-ups now find nothing to do
    assert [run_shard(sid, engine, settings=settings, owner="w2", device="cpu").status
            for sid in shard_ids[1:]] == ["skipped"] * 3
    rows = rows_of(any_db, bid)
    assert [r.status for r in rows] == ["completed"] * 10 and {r.worker for r in rows} == {"w1"}
    shards = shards_of(any_db, bid)
    assert all(sh.status == "done" and sh.attempt == 1 for sh in shards)
    # the shard counters count each request once, with the rows
    assert sum(sh.completed_count for sh in shards) == 10
    assert sum(sh.completion_tokens for sh in shards) == sum(r.completion_tokens for r in rows)
    result = finalize_batch(bid, settings=settings, store=store)
    assert (result.status, result.output_lines, result.error_lines) == ("completed", 10, 0)


def test_shards_whose_wake_up_is_fresh_are_left_to_idle_workers(any_db, settings_env, tmp_path, engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", shard_max_requests=2,
                            claim_ahead_after_seconds=3600)
    store = get_object_store()
    bid, shard_ids = ingested(any_db, store, settings, engine, [line(i) for i in range(4)])
    run = run_shard(shard_ids[0], engine, settings=settings, owner="w1", device="cpu")
    assert run.status == "done" and run.shards_done == [shard_ids[0]]     # the other is another worker's
    assert run_shard(shard_ids[1], engine, settings=settings, owner="w2", device="cpu").shards_done == [shard_ids[1]]
    assert {sh.worker for sh in shards_of(any_db, bid)} == {"w1", "w2"}


def test_a_cancelled_batch_stops_alone_while_the_stream_finishes_the_other(pg_db, settings_env, tmp_path,
                                                                           engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o", heartbeat_seconds=0.3,
                            claim_ahead_after_seconds=0)
    store = get_object_store()
    long_bid, (long_shard,) = ingested(pg_db, store, settings, engine,
                                       [line(i, max_tokens=400, ignore_eos=True) for i in range(2)])
    short_bid, _ = ingested(pg_db, store, settings, engine, [line(i, max_tokens=40, ignore_eos=True)
                                                               for i in range(3)])
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=run_shard(
        long_shard, engine, settings=settings, owner="w", device="cpu")))
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and {sh.status for sh in shards_of(pg_db, short_bid)} != {"running"}:
        time.sleep(0.05)   # the stream took the second batch's shard ahead
    with session_scope(pg_db) as s:
        request_cancel(s, long_bid)
    with session_scope(pg_db) as s:
        assert cancel_now(s, long_bid)
    runner.join(timeout=120)
    assert not runner.is_alive() and result["run"].status == "lease_lost"
    assert [r.status for r in rows_of(pg_db, short_bid)] == ["completed"] * 3      # the other batch finished
    assert all(r.completion_tokens == 40 for r in rows_of(pg_db, short_bid))
    assert finalize_batch(long_bid, settings=settings, store=store).status == "cancelled"
    assert {r.error_code for r in rows_of(pg_db, long_bid)} == {"batch_cancelled"}


def test_an_engine_failure_hands_every_held_shard_back(any_db, settings_env, tmp_path, engine, monkeypatch):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", shard_max_requests=2,
                            claim_ahead_after_seconds=0)
    store = get_object_store()
    bid, shard_ids = ingested(any_db, store, settings, engine,
                              [line(i, max_tokens=30, ignore_eos=True) for i in range(6)])
    calls = {"n": 0}
    execute = engine.runner.execute

    def failing_execute(items, **options):  # noqa: ANN001, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("device lost")
        return execute(items, **options)

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    released = []
    with pytest.raises(RuntimeError, match="device lost"):
        run_shard(shard_ids[0], engine, settings=settings, owner="w", device="cpu", on_released=released.append)
    shards = shards_of(any_db, bid)
    assert sorted(released) == sorted(sh.id for sh in shards if sh.status == "pending") and released
    assert all(sh.status in ("pending", "done") for sh in shards)
    assert all("device lost" in sh.last_error for sh in shards if sh.status == "pending")
    # the next run finishes the batch; nothing is written twice
    monkeypatch.setattr(engine.runner, "execute", execute)
    for sid in released:
        run_shard(sid, engine, settings=settings, owner="w2", device="cpu")
    rows = rows_of(any_db, bid)
    assert [r.status for r in rows] == ["completed"] * 6
    assert sum(sh.completed_count for sh in shards_of(any_db, bid)) == 6


def test_an_idle_engine_s_claim_is_answered_after_the_stream_window_closes(any_db, settings_env, tmp_path, engine,  # noqa: F811
                                                                          monkeypatch):
    """The engine ran out of work inside the stream's window and asked for one more claim while
    the database thread was busy writing; by the time that thread looked, the window had
    closed. The claim is still answered (here: nothing to take), so the run ends instead of
    waiting forever while the database thread keeps renewing its lease."""
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.shard_stream import ShardStream

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", engine_stream_seconds=2.0,
                            result_flush_rows=1, heartbeat_seconds=0.2)
    store = get_object_store()
    bid, (shard_id,) = ingested(any_db, store, settings, engine, [line(i, max_tokens=2) for i in range(2)])
    flush = ShardStream._flush
    slowed = []

    def slow_first_flush(self):  # noqa: ANN001, ANN202
        if not slowed:            # busy past the window's end while the engine goes idle
            slowed.append(time.monotonic())
            time.sleep(max(0.0, self.claim_until - time.monotonic()) + 1.0)
        return flush(self)

    monkeypatch.setattr(ShardStream, "_flush", slow_first_flush)
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=run_shard(
        shard_id, engine, settings=settings, owner="w", device="cpu")), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the run waits forever on a claim nobody answers"
    assert slowed and result["run"].status == "done" and result["run"].shards_done == [shard_id]
    assert [r.status for r in rows_of(any_db, bid)] == ["completed"] * 2


def test_a_failing_database_thread_ends_the_run_and_hands_its_shard_back(any_db, settings_env, tmp_path, engine,  # noqa: F811
                                                                        monkeypatch):
    """A bug while turning an output into its result (not a database hiccup, which is retried)
    stops the database thread: the run ends with that error instead of waiting forever on the
    thread, and the shard goes back to pending unwritten; the next run answers every request
    once."""
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.shard_stream import ShardStream

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", result_flush_rows=1)
    store = get_object_store()
    bid, (shard_id,) = ingested(any_db, store, settings, engine, [line(i, max_tokens=4) for i in range(3)])
    result_of = ShardStream._result_of

    def broken_result_of(self, row, out, endpoint):  # noqa: ANN001, ANN202
        raise ValueError("cannot build this result")

    monkeypatch.setattr(ShardStream, "_result_of", broken_result_of)
    outcome, released = {}, []

    def run() -> None:
        try:
            run_shard(shard_id, engine, settings=settings, owner="w", device="cpu", on_released=released.append)
        except RuntimeError as exc:
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the run waits forever on a database thread that is gone"
    assert "cannot build this result" in str(outcome["error"]) and released == [shard_id]
    (shard,) = shards_of(any_db, bid)
    assert shard.status == "pending" and "cannot build this result" in shard.last_error
    assert {r.status for r in rows_of(any_db, bid)} == {"pending"}
    monkeypatch.setattr(ShardStream, "_result_of", result_of)
    assert run_shard(shard_id, engine, settings=settings, owner="w2", device="cpu").status == "done"
    assert [r.status for r in rows_of(any_db, bid)] == ["completed"] * 3

"""The parts behind model_unavailable, on real Postgres: the engine hosts table (register,
heartbeat, stale rows ignored), validation against the models live workers serve (and the
settings' on a cold start), shards waiting on a model (the notice in the batch's progress, no
re-send while every live worker is backing off, drained as model_unavailable after max attempts
or the wait, a batch where nothing ran failing), and a worker's load back-off (one log line,
no load attempt during the back-off, ready again once the model loads)."""
from __future__ import annotations

import logging
import time

import pytest
from sqlalchemy import select

from nightshift.jobs.batches.finalize import prepare_finalize
from nightshift.jobs.batches.model_waits import note_unavailable, unavailable_notice
from nightshift.jobs.batches.models import Batch, Request, Shard
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.batches.reconcile import reconcile
from nightshift.jobs.engine_hosts import registry
from nightshift.jobs.engine_hosts.models import EngineHost
from nightshift.storage.db import session_scope
from nightshift.workers import engine_host
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from tests.service.factories import make_batch, make_input_file, make_project, make_running_batch


@pytest.fixture
def settings(pg_db, settings_env, tmp_path):
    return settings_env(database_url=pg_db, storage_dir=tmp_path / "objects", max_shard_attempts=3,
                        model_unavailable_after_seconds=600, engine_host_stale_seconds=30,
                        model_load_retry_seconds=1, model_load_retry_max_seconds=4)


@pytest.fixture
def store(settings):
    from nightshift.storage.objectstore import get_object_store
    return get_object_store(settings)


def embedding_batch(db: str, store, model: str) -> str:  # noqa: ANN001
    pid = make_project(db)
    lines = [{"custom_id": f"d{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": "x"}}
             for i in range(2)]
    return make_batch(db, pid, make_input_file(db, store, pid, lines), endpoint="/v1/embeddings")


def test_validation_takes_the_models_live_workers_serve(pg_db, settings, store):
    now = time.time()
    # cold start: no worker registered yet, so the settings' names
    assert ingest_batch(embedding_batch(pg_db, store, "minilm"), settings=settings, store=store).status == "failed"
    with session_scope(pg_db) as s:
        registry.register(s, "gpu-1:11", registry.EMBEDDINGS, "/models/minilm", {"default", "minilm"}, now)
        registry.register(s, "gpu-0:10", registry.EMBEDDINGS, "/models/old", {"legacy"}, now - 600)  # dead: stale
        s.execute(EngineHost.__table__.update().where(EngineHost.worker == "gpu-0:10").values(heartbeat_at=now - 600))
    assert ingest_batch(embedding_batch(pg_db, store, "minilm"), settings=settings, store=store).status == "in_progress"
    refused = embedding_batch(pg_db, store, "legacy")
    assert ingest_batch(refused, settings=settings, store=store).status == "failed"
    with session_scope(pg_db) as s:
        error = s.get(Batch, refused).errors["data"][0]
    assert error["code"] == "model_not_found" and "'legacy'" in error["message"]
    assert "default, minilm" in error["message"]                   # the served ones, the dead worker's not


def test_heartbeat_renews_and_registers_again(pg_db, settings):
    # a clock far past today's: a worker of an earlier test still shutting down may heartbeat into
    # the session's database (a CI run here saw one's chat names), and at today's times it is live
    t = 1e12
    with session_scope(pg_db) as s:
        registry.register(s, "w:1", registry.CHAT, "default", {"default"}, t + 100.0)
    with session_scope(pg_db) as s:
        assert registry.heartbeat(s, "w:1", t + 200.0) == 1
        assert registry.served_names(s, registry.CHAT, t + 210.0, 30) == {"default"}
        assert registry.served_names(s, registry.CHAT, t + 300.0, 30) is None   # stale: nobody alive
        registry.unregister(s, "w:1")
        assert registry.heartbeat(s, "w:1", t + 300.0) == 0                      # gone: register again


def test_a_waiting_shard_shows_why_is_not_resent_while_workers_back_off_and_ends_model_unavailable(
        pg_db, settings, store):
    bid, shards = make_running_batch(pg_db, store, 4, 1)
    now = time.time()
    notice = unavailable_notice("/models/missing", "FileNotFoundError: no config.json")
    with session_scope(pg_db) as s:
        registry.register(s, "gpu:1", registry.CHAT, "/models/missing", {"default"}, now)
        registry.mark_failed(s, "gpu:1", registry.CHAT, "FileNotFoundError", 1, now + 60, now)
        s.execute(Shard.__table__.update().values(enqueued_at=now - 100))
        assert note_unavailable(s, shards[0], notice, now, attempted=True)
    with session_scope(pg_db) as s:
        batch = s.get(Batch, bid)
        progress = batch_progress(s, [batch])[bid].progress()
        assert progress["notice"] == notice and progress["eta_seconds"] is None
        acts = reconcile(s, settings, now=now + 5, queued=set())
        assert shards[0] not in acts.run_shards                      # every live worker backs off: no re-send
    with session_scope(pg_db) as s:
        registry.mark_ready(s, "gpu:1", registry.CHAT, now + 6)
        assert shards[0] in reconcile(s, settings, now=now + 10, queued=set()).run_shards   # it may load now
        note_unavailable(s, shards[0], notice, now + 11, attempted=True)
        note_unavailable(s, shards[0], notice, now + 12, attempted=False)   # a back-off skip: not an attempt
        assert s.get(Shard, shards[0]).attempt == 2
        note_unavailable(s, shards[0], notice, now + 13, attempted=True)
    with session_scope(pg_db) as s:
        reconcile(s, settings, now=now + 14, queued=set())           # 3 attempts: drained
        rows = s.scalars(select(Request).where(Request.batch_id == bid)).all()
        assert {(r.status, r.error_code, r.error_message) for r in rows} == {("failed", "model_unavailable", notice)}
        assert s.get(Batch, bid).status == "finalizing"
    outcome = finalize_batch(bid, settings=settings, store=store)
    with session_scope(pg_db) as s:
        batch = s.get(Batch, bid)
        assert outcome.status == batch.status == "failed" and batch.error_file_id is not None
        assert batch.errors["data"][0] == {"code": "model_unavailable", "message": notice, "param": None, "line": None}


def test_a_long_wait_ends_model_unavailable_and_a_claim_clears_the_wait(pg_db, settings, store):
    bid, shards = make_running_batch(pg_db, store, 4, 2)
    now = time.time()
    with session_scope(pg_db) as s:
        for shard_id in shards:
            note_unavailable(s, shard_id, unavailable_notice("m", "OOM"), now - 700, attempted=True)
    from nightshift.jobs.batches.leases import claim_shard
    with session_scope(pg_db) as s:
        assert claim_shard(s, shards[1], "w", 30) is not None         # a worker that could load it took it
        claimed = s.get(Shard, shards[1])
        assert claimed.load_error is None and claimed.unavailable_since is None
        reconcile(s, settings, now=now, queued=set())                 # 600 s waited: the other one ends
        assert s.get(Shard, shards[0]).status == "cancelled"
        assert s.get(Shard, shards[1]).status == "running"
        assert prepare_finalize(s, bid, 30) is None                   # the running shard keeps it going


def test_load_back_off_one_log_line_and_ready_again(pg_db, settings, caplog, monkeypatch):
    monkeypatch.setattr(engine_host, "_failures", {})
    calls = []

    def broken():
        calls.append(time.monotonic())
        raise FileNotFoundError("/models/x: no config.json")

    caplog.set_level(logging.INFO, logger="nightshift.workers.engine_host")
    with session_scope(pg_db) as s:
        registry.register(s, engine_host.worker_identity(), registry.CHAT, settings.model, {"default"}, time.time())
    with pytest.raises(engine_host.ModelUnavailable) as first:
        engine_host._load(registry.CHAT, settings, broken)
    assert first.value.attempted and first.value.retry_in == pytest.approx(1, abs=0.1)
    with pytest.raises(engine_host.ModelUnavailable) as skipped:       # within the back-off: not tried
        engine_host._load(registry.CHAT, settings, broken)
    assert not skipped.value.attempted and len(calls) == 1
    time.sleep(1.05)
    with pytest.raises(engine_host.ModelUnavailable) as second:
        engine_host._load(registry.CHAT, settings, broken)
    assert second.value.attempted and second.value.retry_in == pytest.approx(2, abs=0.1)   # doubled
    assert len(calls) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no config.json" in errors[0].getMessage()    # the same cause: said once
    assert all(r.exc_info is None for r in caplog.records if r.levelno >= logging.INFO)
    with session_scope(pg_db) as s:
        host = s.get(EngineHost, (engine_host.worker_identity(), registry.CHAT))
        assert host.state == "failed" and host.failures == 2 and "no config.json" in host.error
    time.sleep(2.05)
    assert engine_host._load(registry.CHAT, settings, lambda: "an engine") == "an engine"
    with session_scope(pg_db) as s:
        assert s.get(EngineHost, (engine_host.worker_identity(), registry.CHAT)).state == "ready"
    assert any("loaded after 2 failed attempt(s)" in r.getMessage() for r in caplog.records)

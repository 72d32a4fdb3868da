"""SIGKILL a worker mid-shard (Postgres + Redis + S3 via moto + the real engine): the reconciler
re-enqueues the shard once its lease expires, the new worker skips what was done, and every
custom_id appears exactly once across the output and error files, with the batch's usage and its
cost report equal to the sums of the lines (``bench.invariants``). The same pipeline also runs on
the embedded default (SQLite + local folder + filesystem:// broker)."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from bench.invariants import all_custom_ids, check_batch
from nightshift.jobs.batches.models import Batch, Request, Shard
from nightshift.storage.db import session_scope
from tests.service.celery_procs import kill_group, service_env, start_worker, stop, wait_for
from tests.service.factories import make_batch, make_input_file, make_project

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
N = 6


def lines(n: int) -> list[dict]:
    return [{"custom_id": f"k{i}", "method": "POST", "url": CHAT,
             "body": {"model": "default", "max_tokens": 4 if i < 2 else 24, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Count to {i + 3}."}]}} for i in range(n)]


def batch_status(db_url: str, bid: str) -> str:
    with session_scope(db_url) as s:
        return s.get(Batch, bid).status


def done_rows(db_url: str, bid: str) -> dict[str, tuple]:
    with session_scope(db_url) as s:
        return {r.custom_id: (r.attempt, r.finished_at, r.worker) for r in s.scalars(
            select(Request).where(Request.batch_id == bid, Request.status != "pending"))}


def test_sigkill_mid_shard_reports_every_custom_id_exactly_once(pg_db, redis_url, s3_server, s3_bucket,
                                                                 settings_env, tmp_path):
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.celery_app import TASK_INGEST, make_celery

    conf = dict(database_url=pg_db, broker_url=redis_url, object_store="s3", s3_bucket=s3_bucket,
                s3_endpoint_url=s3_server, s3_access_key_id="t", s3_secret_access_key="t",
                lease_seconds=6, heartbeat_seconds=1, reconcile_interval_seconds=2,
                requeue_pending_after_seconds=30, result_flush_rows=1, engine_max_num_seqs=1)
    settings = settings_env(**conf)
    store = get_object_store()
    env = service_env(**conf)
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, lines(N)))
    cpu = start_worker(env, "cpu,upkeep", "cpu", tmp_path / "cpu.log", beat=True)
    gpu1 = start_worker(env, "gpu", "gpu1", tmp_path / "gpu1.log")
    gpu2 = None
    try:
        make_celery(settings).send_task(TASK_INGEST, args=[bid], queue="cpu")
        # let the first worker finish some requests of the shard, then kill it (and its pool child)
        wait_for(lambda: len(done_rows(pg_db, bid)) >= 2, 600, 0.1, "two finished requests")
        kill_group(gpu1)
        before = done_rows(pg_db, bid)
        assert 2 <= len(before) < N, "the kill must land mid-shard"
        with session_scope(pg_db) as s:
            (shard,) = s.scalars(select(Shard).where(Shard.batch_id == bid)).all()
            assert shard.status == "running" and shard.attempt == 1
        gpu2 = start_worker(env, "gpu", "gpu2", tmp_path / "gpu2.log")
        wait_for(lambda: batch_status(pg_db, bid) == "completed", 600, 1.0, "batch completed")
        after = done_rows(pg_db, bid)
    finally:
        for proc in (gpu2, gpu1, cpu):
            if proc is not None:
                stop(proc)
    ids = all_custom_ids(store, pg_db, bid)
    assert sorted(ids) == sorted(f"k{i}" for i in range(N))  # exactly once each
    check = check_batch(pg_db, store, bid, [f"k{i}" for i in range(N)])
    assert check.ok and check.status == "completed", check   # usage and cost totals = the lines' sums
    for cid, row in before.items():
        assert after[cid] == row  # written once by attempt 1, never rewritten
    assert {after[c][0] for c in after if c not in before} == {2}
    with session_scope(pg_db) as s:
        (shard,) = s.scalars(select(Shard).where(Shard.batch_id == bid)).all()
        assert (shard.status, shard.attempt, shard.completed_count) == ("done", 2, N)


def test_embedded_default_runs_the_same_pipeline(settings_env, tmp_path):
    """SQLite + local folder + filesystem:// broker, one worker with beat: a batch completes."""
    from nightshift.migrations import upgrade_head
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.celery_app import TASK_INGEST, make_celery

    home = tmp_path / "home"
    settings = settings_env(home=home)
    db_url = settings.resolved_database_url
    upgrade_head(db_url)
    store = get_object_store()
    env = service_env(home=home)
    pid = make_project(db_url)
    bid = make_batch(db_url, pid, make_input_file(db_url, store, pid, lines(3)))
    worker = start_worker(env, "cpu,gpu,upkeep", "embedded", tmp_path / "embedded.log", beat=True, concurrency=2)
    try:
        make_celery(settings).send_task(TASK_INGEST, args=[bid], queue="cpu")
        wait_for(lambda: batch_status(db_url, bid) == "completed", 600, 1.0, "batch completed")
    finally:
        stop(worker)
    assert sorted(all_custom_ids(store, db_url, bid)) == ["k0", "k1", "k2"]
    assert check_batch(db_url, store, bid, ["k0", "k1", "k2"]).ok


def test_two_engine_workers_share_a_batch_and_answer_each_line_once(pg_db, redis_url, s3_server, s3_bucket,
                                                                     settings_env, tmp_path):
    """A batch cut into several shards, two idle engine workers: both get shards (each takes its
    own wake-ups; a busy one takes ahead only what nobody picked up), and every line is
    answered once."""
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.celery_app import TASK_INGEST, make_celery

    conf = dict(database_url=pg_db, broker_url=redis_url, object_store="s3", s3_bucket=s3_bucket,
                s3_endpoint_url=s3_server, s3_access_key_id="t", s3_secret_access_key="t", shard_max_requests=2)
    settings = settings_env(**conf)
    store = get_object_store()
    env = service_env(**conf)
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, lines(8)))
    procs = [start_worker(env, "cpu,upkeep", "cpu", tmp_path / "cpu.log", beat=True)]
    procs += [start_worker(env, "gpu", f"gpu{i}", tmp_path / f"gpu{i}.log") for i in (1, 2)]
    try:
        for i in (1, 2):
            wait_for(lambda i=i: "ready" in (tmp_path / f"gpu{i}.log").read_text(errors="replace"), 120, 0.2,
                     f"engine worker {i} ready")
        make_celery(settings).send_task(TASK_INGEST, args=[bid], queue="cpu")
        wait_for(lambda: batch_status(pg_db, bid) == "completed", 600, 0.5, "batch completed")
    finally:
        for proc in procs:
            stop(proc)
    assert sorted(all_custom_ids(store, pg_db, bid)) == sorted(f"k{i}" for i in range(8))
    assert check_batch(pg_db, store, bid, [f"k{i}" for i in range(8)]).ok
    with session_scope(pg_db) as s:
        shards = s.scalars(select(Shard).where(Shard.batch_id == bid)).all()
        workers = {sh.worker for sh in shards}
        assert len(shards) == 4 and all(sh.status == "done" and sh.attempt == 1 for sh in shards)
        assert sum(sh.completed_count for sh in shards) == 8
    assert len(workers) == 2, workers

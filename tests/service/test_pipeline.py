"""The pipeline in-process with the real engine: ingest -> run_shard -> finalize, per-request
failures isolated, usage and prefix-cache hits recorded, re-run shard skips done rows."""
from __future__ import annotations

import pytest
from sqlalchemy import select

from nightshift.jobs.batches.models import Batch, Request, Shard
from nightshift.jobs.batches.progress import batch_progress
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from tests.service.factories import (make_batch, make_input_file, make_project, read_result_lines,
                                     run_batch_in_process)

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
SYSTEM = ("You are Nightshift's test assistant. You answer every question with one short sentence, "
          "you never use lists, and you always stay polite and factual. ") * 2


@pytest.fixture(scope="session")
def engine():
    from nightshift.workers.engine_host import get_engine

    return get_engine()


def line(i: int, **body) -> dict:
    base = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Name color {i}."}]}
    base.update(body)
    return {"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": base}


def run_batch(db_url, store, settings, engine, lines):  # noqa: ANN001
    from nightshift.workers.engine_host import engine_device
    from nightshift.workers.shard_stream import run_shard

    return run_batch_in_process(db_url, store, settings, lines, endpoint=CHAT, tokenizer=engine.tokenizer,
                                run_one=lambda sid: run_shard(sid, engine, settings=settings, owner="test-worker",
                                                              device=engine_device(engine)))


def test_batch_runs_end_to_end_with_isolated_failures(any_db, settings_env, tmp_path, engine):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    lines = [line(i) for i in range(4)]
    lines.append(line(4, max_tokens=engine.max_model_len + 10))   # prompt + max_tokens > context
    lines.append(line(5, temperature=7))                            # bad sampling value
    bid, shard_ids = run_batch(any_db, store, settings, engine, lines)
    result = finalize_batch(bid, settings=settings, store=store)
    assert (result.status, result.output_lines, result.error_lines) == ("completed", 4, 2)
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        p = batch_progress(s, [b])[bid]
        rows = s.scalars(select(Request).where(Request.batch_id == bid).order_by(Request.line)).all()
        shards = s.scalars(select(Shard).where(Shard.batch_id == bid)).all()
    out, errs = read_result_lines(store, any_db, b.output_file_id), read_result_lines(store, any_db, b.error_file_id)
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c3"]
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["model"] == engine.model_name and body["usage"]["completion_tokens"] <= 4
        assert isinstance(body["choices"][0]["message"]["content"], str)
    codes = {e["custom_id"]: e["response"]["body"]["error"]["code"] for e in errs}
    assert codes == {"c4": "context_length_exceeded", "c5": "invalid_request"}
    assert errs[1]["response"]["body"]["error"]["param"] == "temperature"
    # usage on the batch = sums of the rows; accounting columns filled
    assert p.request_counts() == {"total": 6, "completed": 4, "failed": 2}
    assert p.input_tokens == sum(r.prompt_tokens for r in rows if r.status == "completed")
    assert p.output_tokens == sum(r.completion_tokens for r in rows) > 0
    done = [r for r in rows if r.status == "completed"]
    assert all(r.engine_seconds > 0 and r.worker == "test-worker" and r.device == "cpu" and r.attempt == 1
               and r.queued_at <= r.started_at <= r.finished_at for r in done)
    # the shared system prompt is served from the prefix cache and recorded on the shard and batch
    assert sum(sh.prefix_hit_tokens for sh in shards) == p.cached_tokens > 0


def test_rerun_of_a_done_shard_writes_nothing(any_db, settings_env, tmp_path, engine):
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.shard_stream import run_shard

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    bid, shard_ids = run_batch(any_db, store, settings, engine, [line(i) for i in range(2)])
    again = run_shard(shard_ids[0], engine, settings=settings, owner="other", device="cpu")
    assert again.status == "skipped"
    with session_scope(any_db) as s:
        assert {r.worker for r in s.scalars(select(Request).where(Request.batch_id == bid))} == {"test-worker"}


def test_cancel_mid_shard_stops_the_engine_via_heartbeat(pg_db, settings_env, tmp_path, engine):
    import threading
    import time

    from nightshift.jobs.batches.lifecycle import cancel_now, request_cancel
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.shard_stream import run_shard

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o", heartbeat_seconds=0.3)
    store = get_object_store()
    pid = make_project(pg_db)
    long = [line(i, max_tokens=400, ignore_eos=True) for i in range(3)]
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, long))
    (shard_id,) = ingest_batch(bid, engine.tokenizer, settings=settings, store=store).shard_ids
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=run_shard(
        shard_id, engine, settings=settings, owner="w", device="cpu")))
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with session_scope(pg_db) as s:
            if s.get(Shard, shard_id).status == "running":
                break
        time.sleep(0.1)
    time.sleep(1.0)
    with session_scope(pg_db) as s:
        request_cancel(s, bid)
    with session_scope(pg_db) as s:
        assert cancel_now(s, bid)
    cancelled_at = time.monotonic()
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert result["run"].status == "lease_lost"
    assert time.monotonic() - cancelled_at < 15  # vs 3 x 400 tokens still to generate
    out = finalize_batch(bid, settings=settings, store=store)
    assert (out.status, out.output_lines, out.error_lines) == ("cancelled", 0, 3)

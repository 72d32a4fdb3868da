"""Leases, compare-and-set writes, drain on cancel/expiry, idempotent finalize, reconciler —
on real Postgres and SQLite, with the local and the S3 (moto server) object store."""
from __future__ import annotations

import time

import orjson
import pytest
from sqlalchemy import select, update

from nightshift.jobs.batches.leases import (LeaseLost, RequestResult, claim_shard, complete_shard, pending_requests,
                                            write_results)
from nightshift.jobs.batches.lifecycle import InvalidTransition, cancel_now, request_cancel, start_finalize_if_done
from nightshift.jobs.batches.models import Batch, Request, RequestStatus, Shard
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.batches.reconcile import reconcile
from nightshift.jobs.files.models import File
from nightshift.storage.db import session_scope
from nightshift.workers.batch_upkeep import expire_due_batches
from nightshift.workers.finalize import finalize_batch
from tests.service.factories import in_transaction, make_running_batch


@pytest.fixture
def settings(any_db, settings_env, tmp_path):
    return settings_env(database_url=any_db, storage_dir=tmp_path / "objects", lease_seconds=30)


@pytest.fixture
def store(settings):
    from nightshift.storage.objectstore import get_object_store

    return get_object_store(settings)


def ok(row_id: int, text: str = "fine", cached: int = 1) -> RequestResult:
    return RequestResult(row_id, RequestStatus.COMPLETED, response_status_code=200,
                         response_body={"choices": [{"message": {"content": text}}]}, finish_reason="stop",
                         prompt_tokens=3, cached_tokens=cached, completion_tokens=2, engine_seconds=0.5,
                         finished_at=time.time())


def read_jsonl(store, batch_id: str, file_id: str | None, db_url: str) -> list[dict]:  # noqa: ANN001
    if file_id is None:
        return []
    with session_scope(db_url) as s:
        key = s.get(File, file_id).object_key
    return [orjson.loads(x) for x in b"".join(store.get_stream(key)).splitlines()]


def test_stale_lease_cannot_write_and_rerun_skips_done(any_db, settings, store):
    bid, (shard,) = make_running_batch(any_db, store, 4, 1)
    lease1 = in_transaction(any_db, claim_shard, shard, "w1", lease_seconds=30)
    assert lease1 is not None and lease1.attempt == 1
    assert in_transaction(any_db, claim_shard, shard, "w2", lease_seconds=30) is None  # lease is live
    rows = in_transaction(any_db, pending_requests, lease1)
    assert in_transaction(any_db, write_results, lease1, [ok(rows[0].id), ok(rows[1].id)], 30) == 2
    # w1 dies; its lease expires; the reconciler hands the shard back and w2 claims it
    acts = in_transaction(any_db, reconcile, settings, now=time.time() + 60)
    assert acts.run_shards == [shard]
    lease2 = in_transaction(any_db, claim_shard, shard, "w2", lease_seconds=30)
    assert lease2 is not None and lease2.attempt == 2 and lease2.token != lease1.token
    assert [r.custom_id for r in in_transaction(any_db, pending_requests, lease2)] == ["req-2", "req-3"]
    # the stale worker comes back: its write is rejected, nothing changes
    with pytest.raises(LeaseLost):
        in_transaction(any_db, write_results, lease1, [ok(rows[2].id, "stale")], 30)
    # the new attempt writing an already-done row is a no-op (exactly once)
    assert in_transaction(any_db, write_results, lease2,
                          [ok(rows[0].id, "dup"), ok(rows[2].id), ok(rows[3].id)], 30) == 2
    assert in_transaction(any_db, complete_shard, lease2)
    with session_scope(any_db) as s:
        texts = {r.custom_id: r.response_body["choices"][0]["message"]["content"]
                 for r in s.scalars(select(Request).where(Request.batch_id == bid))}
        attempts = {r.custom_id: r.attempt for r in s.scalars(select(Request).where(Request.batch_id == bid))}
        sh = s.get(Shard, shard)
        assert (sh.completed_count, sh.prefix_hit_tokens, sh.completion_tokens) == (4, 4, 8)
        assert start_finalize_if_done(s, bid)
    assert texts == {"req-0": "fine", "req-1": "fine", "req-2": "fine", "req-3": "fine"}
    assert attempts == {"req-0": 1, "req-1": 1, "req-2": 2, "req-3": 2}


def test_finalize_writes_line_ordered_files_and_is_idempotent(any_db, settings, store):
    bid, shards = make_running_batch(any_db, store, 6, 2)
    for shard in shards:
        lease = in_transaction(any_db, claim_shard, shard, "w", 30)
        rows = in_transaction(any_db, pending_requests, lease)
        results = [ok(r.id) if r.line % 3 else
                   RequestResult(r.id, RequestStatus.FAILED, response_status_code=400,
                                 response_body={"error": {"code": "context_length_exceeded", "message": "long",
                                                          "type": "invalid_request_error", "param": None}},
                                 finish_reason="error") for r in rows]
        in_transaction(any_db, write_results, lease, results, 30)
        assert in_transaction(any_db, complete_shard, lease)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
        assert not start_finalize_if_done(s, bid)  # only one caller wins
    first = finalize_batch(bid, settings=settings, store=store)
    assert (first.status, first.output_lines, first.error_lines) == ("completed", 4, 2)
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        out_id, err_id = b.output_file_id, b.error_file_id
        progress = batch_progress(s, [b])[bid]
    assert progress.request_counts() == {"total": 6, "completed": 4, "failed": 2}
    out = read_jsonl(store, bid, out_id, any_db)
    errs = read_jsonl(store, bid, err_id, any_db)
    assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-3", "req-4"]  # input order
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert [(e["custom_id"], e["response"]["status_code"], e["error"]) for e in errs] == [("req-2", 400, None),
                                                                                           ("req-5", 400, None)]
    assert errs[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    # a crash after the files were written but before the status commit: finalize runs again
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(status="finalizing"))
    again = finalize_batch(bid, settings=settings, store=store)
    assert again.status == "completed"
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert (b.output_file_id, b.error_file_id) == (out_id, err_id)
        assert s.query(File).filter(File.purpose == "batch_output").count() == 4  # output, errors, cost.json, cost.csv
        assert s.get(File, out_id).expires_at is None                          # kept until deleted
    assert read_jsonl(store, bid, out_id, any_db) == out
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"  # terminal: no-op


def test_a_failed_finalize_hands_its_lease_back(any_db, settings, store, monkeypatch):
    """A finalize that raises (here: the object store refuses its writes) hands its lease back,
    so the reconciler can send it again at once; a lease another finalize has taken since is
    left alone. The next finalize completes the batch."""
    bid, shards = make_running_batch(any_db, store, 3, 1)
    lease = in_transaction(any_db, claim_shard, shards[0], "w", 30)
    in_transaction(any_db, write_results, lease, [ok(r.id) for r in in_transaction(any_db, pending_requests, lease)], 30)
    assert in_transaction(any_db, complete_shard, lease)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
    real_put = type(store).put_stream

    def refused(*args, **kwargs):
        raise OSError("object store unreachable")

    monkeypatch.setattr(type(store), "put_stream", refused)
    with pytest.raises(OSError):
        finalize_batch(bid, settings=settings, store=store)
    with session_scope(any_db) as s:
        assert s.get(Batch, bid).finalize_lease_expires_at is None          # handed back
    from nightshift.jobs.batches.finalize import prepare_finalize, release_finalize_lease
    with session_scope(any_db) as s:
        plan = prepare_finalize(s, bid, 30)                                 # another finalize takes it
    with session_scope(any_db) as s:
        assert not release_finalize_lease(s, bid, plan.lease_expires_at - 1)   # not ours: left alone
        assert s.get(Batch, bid).finalize_lease_expires_at == plan.lease_expires_at
        assert release_finalize_lease(s, bid, plan.lease_expires_at)
    monkeypatch.setattr(type(store), "put_stream", real_put)
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"


def test_cancel_mid_run_keeps_finished_and_drains_the_rest(any_db, settings, store):
    bid, (s1, s2) = make_running_batch(any_db, store, 6, 2)
    lease = in_transaction(any_db, claim_shard, s1, "w", 30)
    done = in_transaction(any_db, pending_requests, lease)[:2]
    in_transaction(any_db, write_results, lease, [ok(r.id) for r in done], 30)
    with session_scope(any_db) as s:
        assert request_cancel(s, bid).status == "cancelling"
    with session_scope(any_db) as s:
        assert request_cancel(s, bid).status == "cancelling"  # idempotent
        assert cancel_now(s, bid)
    # the worker still running shard 1 has lost its lease: its late write is refused
    rest = [r for r in in_transaction(any_db, pending_requests, lease)]
    assert rest == []
    with pytest.raises(LeaseLost):
        in_transaction(any_db, write_results, lease, [ok(done[0].id)], 30)
    assert in_transaction(any_db, claim_shard, s2, "w2", 30) is None
    result = finalize_batch(bid, settings=settings, store=store)
    assert (result.status, result.output_lines, result.error_lines) == ("cancelled", 2, 4)
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert b.cancelled_at is not None
        assert batch_progress(s, [b])[bid].request_counts() == {"total": 6, "completed": 2, "failed": 4}
        with pytest.raises(InvalidTransition):
            s.execute(update(Batch).where(Batch.id == bid).values(status="completed"))
            request_cancel(s, bid)
    errs = read_jsonl(store, bid, b.error_file_id, any_db)
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"} and all(e["response"] is None for e in errs)
    ids = [o["custom_id"] for o in read_jsonl(store, bid, b.output_file_id, any_db)] + [e["custom_id"] for e in errs]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(6))


def test_expiry_keeps_partial_results(any_db, settings, store):
    bid, (s1,) = make_running_batch(any_db, store, 3, 1)
    lease = in_transaction(any_db, claim_shard, s1, "w", 30)
    first = in_transaction(any_db, pending_requests, lease)[0]
    in_transaction(any_db, write_results, lease, [ok(first.id)], 30)
    with session_scope(any_db) as s:
        expires = s.get(Batch, bid).expires_at
    assert in_transaction(any_db, reconcile, settings, now=expires - 1).finalize == []
    assert expire_due_batches(settings, now=expires - 1) == []
    assert expire_due_batches(settings, now=expires + 1) == [bid]
    assert expire_due_batches(settings, now=expires + 2) == []  # once
    with pytest.raises(LeaseLost):
        in_transaction(any_db, write_results, lease,
                       [ok(r.id) for r in in_transaction(any_db, pending_requests, lease)] or [ok(first.id)], 30)
    result = finalize_batch(bid, settings=settings, store=store)
    assert (result.status, result.output_lines, result.error_lines) == ("expired", 1, 2)
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert b.expired_at is not None and b.status == "expired"
    errs = read_jsonl(store, bid, b.error_file_id, any_db)
    assert [e["error"]["code"] for e in errs] == ["batch_expired", "batch_expired"]


def test_reconciler_resends_lost_messages_and_gives_up_after_max_attempts(any_db, store, settings_env, tmp_path):
    settings = settings_env(storage_dir=tmp_path / "objects", max_shard_attempts=2, requeue_pending_after_seconds=5)
    bid, (shard,) = make_running_batch(any_db, store, 2, 1)
    now = time.time()
    assert in_transaction(any_db, reconcile, settings, now=now).run_shards == []  # message is fresh
    assert in_transaction(any_db, reconcile, settings, now=now + 10).run_shards == [shard]  # lost wake-up
    assert in_transaction(any_db, reconcile, settings, now=now + 11).run_shards == []  # just re-sent
    for attempt in (1, 2):
        lease = in_transaction(any_db, claim_shard, shard, f"w{attempt}", 1, now=now + 20 * attempt)
        assert lease.attempt == attempt
        acts = in_transaction(any_db, reconcile, settings, now=now + 20 * attempt + 5)
    # the second expired lease hit max_shard_attempts: requests drained, batch ready to finalize
    assert acts.run_shards == [] and acts.finalize == [bid]
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"
    with session_scope(any_db) as s:
        codes = s.scalars(select(Request.error_code).where(Request.batch_id == bid)).all()
    assert codes == ["shard_failed", "shard_failed"]


def _finish_all(db_url: str, shards: list[int]) -> None:
    for shard in shards:
        lease = in_transaction(db_url, claim_shard, shard, "w", 30)
        in_transaction(db_url, write_results, lease, [ok(r.id) for r in in_transaction(db_url, pending_requests, lease)],
                       30)
        assert in_transaction(db_url, complete_shard, lease)


def test_two_finalizes_at_once_both_end_cleanly_and_nothing_empty_is_stored(any_db, settings, store):
    """A finalize re-sent while the first still runs: the second finds the first's live lease and
    leaves the work to it (or, if it comes after, finds the batch completed); neither fails,
    one set of rows describes the objects, and a batch with no failed line gets no (empty)
    errors.jsonl."""
    import threading

    bid, shards = make_running_batch(any_db, store, 4, 2)
    _finish_all(any_db, shards)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
    outcomes, errors = [], []

    def run():  # noqa: ANN202
        try:
            outcomes.append(finalize_batch(bid, settings=settings, store=store).status)
        except Exception as exc:  # noqa: BLE001 - the test reports any failure
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and "completed" in outcomes and set(outcomes) <= {"completed", "finalizing"}
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert b.status == "completed" and b.finalize_lease_expires_at is None
        assert b.error_file_id is None and b.output_file_id is not None
        assert s.query(File).filter(File.purpose == "batch_output").count() == 3   # output, cost.json, cost.csv
    assert not store.exists(f"batches/{bid}/errors.jsonl")
    assert len(read_jsonl(store, bid, b.output_file_id, any_db)) == 4


def test_a_finalize_with_a_live_lease_is_not_re_sent_one_that_ran_out_is(any_db, settings, store):
    bid, shards = make_running_batch(any_db, store, 2, 1)
    _finish_all(any_db, shards)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
    later = time.time() + 3600                           # long after the finalize message went out
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(finalize_lease_expires_at=later + 30))
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=later).finalize          # a finalize is running
    with session_scope(any_db) as s:
        assert bid in reconcile(s, settings, now=later + 60).finalize         # its lease ran out


def test_a_lost_finalize_wake_up_is_re_sent_in_seconds_when_the_queue_shows_it_missing(any_db, settings, store):
    """A batch moved to finalizing while the broker was down (its finalize wake-up lost), or whose
    finalize died (its lease ran out): re-sent once ``requeue_missing_after_seconds`` have passed
    and its message is not waiting in the cpu queue, not after ``requeue_pending_after_seconds``;
    left alone while it waits there; where the queue cannot be read, the old rule applies."""
    settings = settings.model_copy(update={"requeue_missing_after_seconds": 5, "requeue_pending_after_seconds": 60})
    bid, shards = make_running_batch(any_db, store, 2, 1)
    _finish_all(any_db, shards)
    with session_scope(any_db) as s:
        assert start_finalize_if_done(s, bid)
        sent = s.get(Batch, bid).last_enqueued_at
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=sent + 3, queued_batches=set()).finalize      # just sent
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=sent + 6, queued_batches={bid}).finalize      # waits in the queue
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=sent + 6).finalize                            # queue unknown
    with session_scope(any_db) as s:
        assert reconcile(s, settings, now=sent + 6, queued_batches=set()).finalize == [bid]       # lost: re-sent
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=sent + 8, queued_batches=set()).finalize      # sent again just now
    # the finalize that took that message dies inside its writes: re-sent once its lease runs out
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(finalize_lease_expires_at=sent + 6 + 30))
    with session_scope(any_db) as s:
        assert bid not in reconcile(s, settings, now=sent + 30, queued_batches=set()).finalize     # lease live
    with session_scope(any_db) as s:
        assert reconcile(s, settings, now=sent + 37, queued_batches=set()).finalize == [bid]      # lease ran out


def test_output_expires_after_dates_the_output_and_error_files(any_db, settings, store):
    bid, shards = make_running_batch(any_db, store, 2, 1)
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(output_expires_after_seconds=7200))
    lease = in_transaction(any_db, claim_shard, shards[0], "w", 30)
    rows = in_transaction(any_db, pending_requests, lease)
    failed = RequestResult(rows[1].id, RequestStatus.FAILED, response_status_code=400,
                           response_body={"error": {"code": "invalid_request", "message": "no"}}, finish_reason="error")
    in_transaction(any_db, write_results, lease, [ok(rows[0].id), failed], 30)
    assert in_transaction(any_db, complete_shard, lease)
    in_transaction(any_db, start_finalize_if_done, bid)
    before = time.time()
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        for file_id in (b.output_file_id, b.error_file_id):
            assert before + 7200 <= s.get(File, file_id).expires_at <= time.time() + 7200


def test_a_lost_cancel_wake_up_is_re_sent_once_the_queue_shows_it_missing(any_db, settings, store):
    settings = settings.model_copy(update={"requeue_missing_after_seconds": 5, "requeue_pending_after_seconds": 60})
    bid, _ = make_running_batch(any_db, store, 2, 1)
    with session_scope(any_db) as s:
        s.execute(update(Batch).where(Batch.id == bid).values(last_enqueued_at=time.time() - 3600))
    with session_scope(any_db) as s:
        cancelled_at = request_cancel(s, bid).cancelling_at      # the cancel wake-up goes out now
    with session_scope(any_db) as s:
        assert reconcile(s, settings, now=cancelled_at + 3, queued_batches=set()).cancel == []   # just sent
    with session_scope(any_db) as s:
        assert reconcile(s, settings, now=cancelled_at + 6, queued_batches={bid}).cancel == []   # waiting
    with session_scope(any_db) as s:
        assert reconcile(s, settings, now=cancelled_at + 6, queued_batches=set()).cancel == [bid]   # lost

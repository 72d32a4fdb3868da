"""Celery tasks. Each re-reads database state and does nothing when its work is already done,
so a redelivered or duplicated message is harmless. Domain rules live in jobs/."""
from __future__ import annotations

import logging

from nightshift.jobs.batches import cancel_now
from nightshift.jobs.finalize import finalize_batch
from nightshift.jobs.ingest import ingest_batch
from nightshift.jobs.reconcile import expire_batches, reconcile
from nightshift.storage.db import session_scope
from nightshift.workers import dispatch
from nightshift.workers.celery_app import (TASK_CANCEL, TASK_EXPIRE, TASK_FINALIZE, TASK_INGEST, TASK_RECONCILE,
                                TASK_RUN_SHARD, app)
from nightshift.workers.engine_host import engine_device, get_engine, get_tokenizer, worker_identity

log = logging.getLogger(__name__)


@app.task(name=TASK_INGEST)
def ingest(batch_id: str) -> str:
    outcome = ingest_batch(batch_id, get_tokenizer())
    for shard_id in outcome.shard_ids:  # published after ingest's commit
        dispatch.enqueue_run_shard(shard_id)
    if outcome.status == "cancelling":
        dispatch.enqueue_cancel(batch_id)
    return outcome.status


@app.task(name=TASK_RUN_SHARD)
def run_shard(shard_id: int) -> str:
    from nightshift.workers.shard_runner import run_shard as run

    engine = get_engine()
    result = run(shard_id, engine, owner=worker_identity(), device=engine_device(engine))
    if result.finalize:
        dispatch.enqueue_finalize(result.lease.batch_id)
    return result.status


@app.task(name=TASK_FINALIZE)
def finalize(batch_id: str) -> str:
    return finalize_batch(batch_id).status


@app.task(name=TASK_CANCEL)
def cancel(batch_id: str) -> str:
    with session_scope() as s:
        ready = cancel_now(s, batch_id)
    if ready:
        return finalize_batch(batch_id).status
    return "noop"


@app.task(name=TASK_RECONCILE)
def reconcile_tick() -> dict:
    acts = reconcile()
    for shard_id in acts.run_shards:
        dispatch.enqueue_run_shard(shard_id)
    for batch_id in acts.finalize:
        dispatch.enqueue_finalize(batch_id)
    for batch_id in acts.cancel:
        dispatch.enqueue_cancel(batch_id)
    for batch_id in acts.ingest:
        dispatch.enqueue_ingest(batch_id)
    if any((acts.run_shards, acts.finalize, acts.cancel, acts.ingest)):
        log.info("reconcile: %s", acts)
    return {"run_shards": acts.run_shards, "finalize": acts.finalize, "cancel": acts.cancel, "ingest": acts.ingest}


@app.task(name=TASK_EXPIRE)
def expire_tick() -> list[str]:
    expired = expire_batches()
    for batch_id in expired:
        dispatch.enqueue_finalize(batch_id)
    return expired

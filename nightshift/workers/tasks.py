"""Celery tasks of batches. Each re-reads database state and does nothing when its work is
already done, so a redelivered or duplicated message is harmless. A task owns the
transactions of its work (here, or in the flow module it calls: ``ingest``,
``shard_stream``, ``finalize``, ``batch_upkeep``) and sends wake-ups only after they commit.
Domain rules live in jobs/."""
from __future__ import annotations

import logging
import time

from nightshift.jobs.batches.leases import shard_endpoint
from nightshift.jobs.batches.model_waits import note_unavailable, unavailable_notice
from nightshift.jobs.batches.lifecycle import cancel_now
from nightshift.jobs.batches.models import BatchStatus
from nightshift.jobs.batches.openai_mapping import EMBEDDINGS
from nightshift.settings import get_settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import get_object_store
from nightshift.workers import dispatch
from nightshift.workers.batch_upkeep import expire_due_batches, reconcile_batches
from nightshift.workers.celery_app import (TASK_CANCEL, TASK_EXPIRE, TASK_FINALIZE, TASK_INGEST, TASK_RECONCILE,
                                           TASK_RUN_SHARD, TASK_SWEEP_STORAGE, TASK_DELIVER_WEBHOOKS, TASK_EXPIRE_FILES,
                                           app)
from nightshift.workers.engine_host import (ModelUnavailable, engine_device, get_embedding_engine, get_engine,
                                           get_tokenizer, worker_identity)
from nightshift.workers.file_expiry import remove_expired_files
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from nightshift.workers.metrics import worker_metrics
from nightshift.workers.schedule_runs import complete_batch_run
from nightshift.workers.stall_watch import StallWatch
from nightshift.workers.storage_sweep import sweep_storage as sweep_objects
from nightshift.workers.webhooks import deliver_due_webhooks

log = logging.getLogger(__name__)


@app.task(name=TASK_INGEST)
def ingest(batch_id: str) -> str:
    settings = get_settings()
    # The tokenizer is loaded inside ingest (only for a valid file), so a model that cannot load
    # counts as a failed attempt and fails the batch after max_ingest_attempts instead of looping.
    outcome = ingest_batch(batch_id, settings=settings, store=get_object_store(settings),
                           load_tokenizer=lambda: get_tokenizer(settings))
    for shard_id in outcome.shard_ids:
        dispatch.enqueue_run_shard(shard_id)
    if outcome.status == BatchStatus.CANCELLING:
        dispatch.enqueue_cancel(batch_id)
    return outcome.status


@app.task(name=TASK_RUN_SHARD)
def run_shard(shard_id: int) -> str:
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as s:
        endpoint = shard_endpoint(s, shard_id)
    if endpoint is None:
        return "skipped"
    # A load or an engine step that hangs leaves every thread's stack in this worker's log.
    with StallWatch(settings.engine_stall_seconds) as watch:
        # these import the engine: gpu workers only
        try:
            if endpoint == EMBEDDINGS:
                from nightshift.workers.embedding_stream import run_embedding_shard as run
                engine = get_embedding_engine(settings)
            else:
                from nightshift.workers.shard_stream import run_shard as run
                engine = get_engine(settings)
        except ModelUnavailable as exc:
            # The shard stays pending (nothing was claimed); the reconciler sends it again when a
            # worker may load the model, and ends it as model_unavailable after too long.
            with session_scope(settings.resolved_database_url) as s:
                note_unavailable(s, shard_id, unavailable_notice(exc.model, exc.cause), time.time(), exc.attempted)
            return "model_unavailable"
        with watch.steps_of(engine):
            result = run(shard_id, engine, settings=settings, owner=worker_identity(), device=engine_device(engine),
                         on_finalize=dispatch.enqueue_finalize, on_released=dispatch.enqueue_run_shard)
    return result.status


def _finalize(batch_id: str) -> str:
    """Finalize, then complete the schedule run the batch belongs to (if it ended now or in an
    earlier attempt whose completion was lost)."""
    settings = get_settings()
    store = get_object_store(settings)
    outcome = finalize_batch(batch_id, settings=settings, store=store)
    if outcome.status in BatchStatus.TERMINAL:
        complete_batch_run(settings, store, batch_id)
        dispatch.enqueue_deliver_webhooks()   # the batch's event was recorded with its final status
    return outcome.status


@app.task(name=TASK_FINALIZE)
def finalize(batch_id: str) -> str:
    return _finalize(batch_id)


@app.task(name=TASK_CANCEL)
def cancel(batch_id: str) -> str:
    with session_scope(get_settings().resolved_database_url) as s:
        ready = cancel_now(s, batch_id)
    return _finalize(batch_id) if ready else "noop"


@app.task(name=TASK_RECONCILE)
def reconcile_tick() -> dict:
    acts = reconcile_batches(get_settings())
    if acts.expired_leases:
        worker_metrics().lease_expiries.inc(acts.expired_leases)
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
    expired = expire_due_batches(get_settings())
    for batch_id in expired:
        dispatch.enqueue_finalize(batch_id)
    return expired


@app.task(name=TASK_SWEEP_STORAGE)
def sweep_storage() -> dict:
    """What uploads and writes that died midway left in the object store (workers/storage_sweep.py)."""
    settings = get_settings()
    outcome = sweep_objects(settings, get_object_store(settings))
    if outcome.abandoned or outcome.unrecorded:
        log.info("storage sweep: removed %d abandoned upload(s), %d upload(s) without a file row",
                 outcome.abandoned, outcome.unrecorded)
    return {"abandoned": outcome.abandoned, "unrecorded": outcome.unrecorded}


@app.task(name=TASK_EXPIRE_FILES)
def expire_files() -> int:
    """Files past their expiry that nothing needs: object removed, row marked deleted."""
    settings = get_settings()
    removed = remove_expired_files(settings, get_object_store(settings))
    if removed:
        log.info("expired files: removed %d", removed)
    return removed


@app.task(name=TASK_DELIVER_WEBHOOKS)
def deliver_webhooks() -> dict:
    return deliver_due_webhooks(get_settings())

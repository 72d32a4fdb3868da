"""The reconciler (beat): repairs what lost or duplicated Celery messages and dead workers
leave behind, using only database state.

- a running shard whose lease expired (its owner stopped heart-beating) goes back to
  pending and is re-sent; after ``max_shard_attempts`` its unrun requests become error lines;
- a pending shard whose wake-up is not waiting in the broker's queue (the caller reads the
  queue: ``queued``) is re-sent after ``requeue_missing_after_seconds``; where the queue cannot
  be read, once its wake-up is older than ``requeue_pending_after_seconds``. A shard whose
  wake-up still waits is left alone (no duplicate messages piling up), and so is one waiting on
  a model every live engine worker failed to load, until the first of them tries again;
- a pending shard that waited on its model (model_waits.py) for ``max_shard_attempts`` load
  attempts or ``model_unavailable_after_seconds`` is drained: ``model_unavailable`` error lines;
- an in_progress batch whose shards are all terminal moves to finalizing; a finalizing or
  cancelling batch whose finalize holds no live lease is re-sent once its finalize (or cancel)
  wake-up is not waiting in the broker's cpu queue (the caller reads it: ``queued_batches``) and
  was sent ``requeue_missing_after_seconds`` ago (lost with a Redis restart, or taken by a
  worker that died inside finalize, whose lease then ran out); where the queue cannot be read,
  once its message is older than ``requeue_pending_after_seconds``. A validating batch whose
  ingest message is that old is re-sent (an ingest holds no lease that would prove it dead).
Expiry is its own beat task (``nightshift.workers.batch_upkeep.expire_due_batches``): batches
past their window are drained.
Duplicated messages are harmless: every task re-checks state with a conditional UPDATE.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.lifecycle import drain_shard, start_finalize_if_done
from nightshift.jobs.batches.model_waits import MODEL_UNAVAILABLE, expired_waits, load_retry_at
from nightshift.jobs.batches.models import Batch, BatchStatus, Shard, ShardStatus
from nightshift.jobs.batches.openai_mapping import EMBEDDINGS
from nightshift.jobs.engine_hosts.registry import CHAT, EMBEDDINGS as EMBEDDINGS_KIND
from nightshift.settings import Settings


@dataclass
class Actions:
    """Messages to send once the reconciler's transaction has committed."""

    run_shards: list[int] = field(default_factory=list)
    finalize: list[str] = field(default_factory=list)
    ingest: list[str] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    expired_leases: int = 0           # running shards whose worker stopped heart-beating


def reconcile(s: Session, settings: Settings, now: Optional[float] = None,
              queued: Optional[set[int]] = None, queued_batches: Optional[set[str]] = None) -> Actions:
    """One pass over the database state; the messages to send are returned, to be sent once
    the caller has committed. ``queued``: the shard ids whose run_shard wake-up waits in the
    broker's queue now; ``queued_batches``: the batch ids whose finalize or cancel wake-up waits
    there (None: unknown)."""
    now = time.time() if now is None else now
    stale = now - settings.requeue_pending_after_seconds
    acts = Actions()
    live_batch = select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS)
    # 1. expired leases (dead owner) -> pending, or drained after too many attempts
    expired = s.execute(select(Shard.id, Shard.attempt).where(
        Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now, Shard.batch_id.in_(live_batch))).all()
    for shard_id, attempt in expired:
        if attempt >= settings.max_shard_attempts:
            drain_shard(s, shard_id, "shard_failed", now)
            continue
        res = s.execute(update(Shard).where(Shard.id == shard_id, Shard.status == ShardStatus.RUNNING,
                                            Shard.lease_expires_at < now)
                        .values(status=ShardStatus.PENDING, lease_token=None, lease_expires_at=None,
                                enqueued_at=now, last_error="lease expired (worker stopped heart-beating)"))
        if res.rowcount == 1:
            acts.run_shards.append(shard_id)
            acts.expired_leases += 1
    # 2. shards that waited too long on a model no worker could load
    for shard_id, notice in expired_waits(s, now, settings.max_shard_attempts, settings.model_unavailable_after_seconds):
        drain_shard(s, shard_id, MODEL_UNAVAILABLE, now, notice)
    # 3. pending shards whose wake-up is lost
    sent_before = stale if queued is None else now - settings.requeue_missing_after_seconds
    retry_at: dict[str, float | None] = {}
    for shard_id, attempt, load_error, endpoint in s.execute(
            select(Shard.id, Shard.attempt, Shard.load_error, Batch.endpoint).join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == ShardStatus.PENDING, func.coalesce(Shard.enqueued_at, 0) < sent_before,
                   Batch.status == BatchStatus.IN_PROGRESS)).all():
        if queued is not None and shard_id in queued:
            continue
        if load_error is not None:   # no live worker could load its model: wait for the next try
            kind = EMBEDDINGS_KIND if endpoint == EMBEDDINGS else CHAT
            if kind not in retry_at:
                retry_at[kind] = load_retry_at(s, kind, now, settings.engine_host_stale_seconds)
            if retry_at[kind] is not None and retry_at[kind] > now:
                continue
        if attempt >= settings.max_shard_attempts:
            drain_shard(s, shard_id, "shard_failed", now)
            continue
        s.execute(update(Shard).where(Shard.id == shard_id).values(enqueued_at=now))
        acts.run_shards.append(shard_id)
    # 4. batches with nothing left to run
    for (batch_id,) in s.execute(select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS)).all():
        if start_finalize_if_done(s, batch_id, now):
            acts.finalize.append(batch_id)
    # 5. lost finalize / cancel / ingest messages (a finalize holding a live lease is running)
    last_sent = func.coalesce(Batch.last_enqueued_at, Batch.created_at)
    no_live_finalize = or_(Batch.finalize_lease_expires_at.is_(None), Batch.finalize_lease_expires_at < now)
    for status, bucket in ((BatchStatus.FINALIZING, acts.finalize), (BatchStatus.CANCELLING, acts.cancel),
                           (BatchStatus.VALIDATING, acts.ingest)):
        peeked = queued_batches is not None and status != BatchStatus.VALIDATING
        sent_before = now - settings.requeue_missing_after_seconds if peeked else stale
        ids = [i for i in s.scalars(select(Batch.id).where(Batch.status == status, last_sent < sent_before,
                                                           no_live_finalize))
               if not (peeked and i in queued_batches)]
        if ids:
            s.execute(update(Batch).where(Batch.id.in_(ids)).values(last_enqueued_at=now))
            bucket.extend(i for i in ids if i not in bucket)
    return acts

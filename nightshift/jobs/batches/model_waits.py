"""Shards that wait on a model no engine worker could load.

An engine worker whose model fails to load (or whose last load failed and is waiting out its
back-off: workers/engine_host.py) leaves the shard pending and notes it here: the shard's
``load_error`` (what the batch's progress shows: "no worker could load model X: <cause>"), since
when it waits (``unavailable_since``) and, for a load that was really attempted, one more
``attempt``. The reconciler ends such a shard (``expired_waits``) after ``max_shard_attempts``
attempts or ``model_unavailable_after_seconds`` of waiting: its unrun requests become error
lines with code ``model_unavailable`` and that message. A worker that claims the shard (the
model loaded after all) clears both fields.
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Shard, ShardStatus
from nightshift.jobs.engine_hosts.models import EngineHost, HostState

MODEL_UNAVAILABLE = "model_unavailable"


def unavailable_notice(model: str, cause: str) -> str:
    return f"no worker could load model {model}: {cause}"[:2000]


def note_unavailable(s: Session, shard_id: int, notice: str, now: float, attempted: bool) -> bool:
    """Record on a pending shard that its model could not load (``attempted``: a load was tried
    and counts as an attempt; else the worker was waiting out a back-off). False if the shard is
    no longer pending."""
    values = {"load_error": notice, "last_error": notice,
              "unavailable_since": func.coalesce(Shard.unavailable_since, now)}
    if attempted:
        values["attempt"] = Shard.attempt + 1
    res = s.execute(update(Shard).where(Shard.id == shard_id, Shard.status == ShardStatus.PENDING).values(**values))
    return res.rowcount == 1


def expired_waits(s: Session, now: float, max_attempts: int, wait_seconds: float) -> list[tuple[int, str]]:
    """(shard id, notice) of the pending shards of running batches that waited on their model
    for ``max_attempts`` load attempts or ``wait_seconds``: the reconciler drains them."""
    return [(r.id, r.load_error) for r in s.execute(
        select(Shard.id, Shard.load_error).join(Batch, Batch.id == Shard.batch_id)
        .where(Shard.status == ShardStatus.PENDING, Shard.load_error.is_not(None),
               Batch.status == BatchStatus.IN_PROGRESS,
               or_(Shard.attempt >= max_attempts, Shard.unavailable_since < now - wait_seconds))).all()]


def load_retry_at(s: Session, kind: str, now: float, stale_seconds: float) -> Optional[float]:
    """When the first live worker of ``kind`` tries its failed load again; None if some live
    worker of that kind has not failed (a shard can be sent to it now) or none is alive."""
    rows = s.execute(select(EngineHost.state, EngineHost.retry_at).where(
        EngineHost.kind == kind, EngineHost.heartbeat_at >= now - stale_seconds)).all()
    if not rows or any(r.state != HostState.FAILED for r in rows):
        return None
    return min(r.retry_at or now for r in rows)

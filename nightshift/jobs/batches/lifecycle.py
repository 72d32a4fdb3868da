"""Batch state machine: guarded transitions and draining unrun requests.

Every transition is a conditional UPDATE on the current status, so two processes doing
the same step (a duplicated message, the reconciler racing a worker) cannot both win.
"""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy import exists, func, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard, ShardStatus

CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
DRAIN_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
    "shard_failed": "This request could not be executed: its worker failed repeatedly.",
    "model_unavailable": "This request could not be executed: no worker could load its model.",
}


class InvalidTransition(ValueError):
    """The batch cannot make this transition from its current status (the API answers 409)."""

    def __init__(self, batch_id: str, status: str, action: str):
        super().__init__(f"Cannot {action} a batch with status '{status}'.")
        self.batch_id = batch_id
        self.status = status


def request_cancel(s: Session, batch_id: str, now: Optional[float] = None) -> Batch:
    """validating/in_progress -> cancelling; cancelling/cancelled/finalizing stay as they are;
    completed/failed/expired raise InvalidTransition. The caller commits, then sends
    ``nightshift.workers.dispatch.enqueue_cancel(batch_id)``."""
    now = time.time() if now is None else now
    s.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(CANCELLABLE))
              .values(status=BatchStatus.CANCELLING, cancelling_at=now, last_enqueued_at=now))
    batch = s.get(Batch, batch_id, populate_existing=True)
    if batch is None:
        raise LookupError(batch_id)
    if batch.status in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED):
        raise InvalidTransition(batch_id, batch.status, "cancel")
    return batch


def drain_batch(s: Session, batch_id: str, code: str, now: Optional[float] = None) -> int:
    """Revoke every live shard lease of the batch and turn its unrun requests into error lines
    (``response: null, error: {code, message}``). Shard rows are updated first: that waits for a
    worker's in-flight result write (it holds the shard row) and makes its later writes fail."""
    now = time.time() if now is None else now
    s.execute(update(Shard).where(Shard.batch_id == batch_id, Shard.status.in_((ShardStatus.PENDING,
                                                                                 ShardStatus.RUNNING)))
              .values(status=ShardStatus.CANCELLED, lease_token=None, lease_expires_at=None, finished_at=now))
    return _drain_requests(s, Request.batch_id == batch_id, code, now)


def drain_shard(s: Session, shard_id: int, code: str, now: Optional[float] = None,
                message: Optional[str] = None) -> int:
    """Revoke the shard's lease and turn its unrun requests into error lines (``message``: the
    lines' error message, instead of the code's usual one)."""
    now = time.time() if now is None else now
    s.execute(update(Shard).where(Shard.id == shard_id).values(
        status=ShardStatus.CANCELLED, lease_token=None, lease_expires_at=None, finished_at=now))
    return _drain_requests(s, Request.shard_id == shard_id, code, now, message)


def _drain_requests(s: Session, where, code: str, now: float, message: Optional[str] = None) -> int:  # noqa: ANN001
    per_shard = s.execute(select(Request.shard_id, func.count()).where(where, Request.status == RequestStatus.PENDING)
                          .group_by(Request.shard_id)).all()
    if not per_shard:
        return 0
    res = s.execute(update(Request).where(where, Request.status == RequestStatus.PENDING)
                    .values(status=RequestStatus.FAILED, error_code=code, error_message=message or DRAIN_MESSAGES[code],
                            prompt_tokens=0, finished_at=now))  # never run: no tokens used
    for shard_id, n in per_shard:
        if shard_id is not None:
            s.execute(update(Shard).where(Shard.id == shard_id).values(failed_count=Shard.failed_count + n))
    return res.rowcount


def start_finalize_if_done(s: Session, batch_id: str, now: Optional[float] = None) -> bool:
    """in_progress -> finalizing once every shard is terminal; True for the one caller that moved it."""
    now = time.time() if now is None else now
    live = exists().where(Shard.batch_id == batch_id, Shard.status.notin_(ShardStatus.TERMINAL))
    res = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.IN_PROGRESS, ~live)
                    .values(status=BatchStatus.FINALIZING, finalizing_at=now, last_enqueued_at=now))
    return res.rowcount == 1


def cancel_now(s: Session, batch_id: str, now: Optional[float] = None) -> bool:
    """Drain a cancelling batch (idempotent); True if it is ready for finalize."""
    batch = s.get(Batch, batch_id)
    if batch is None or batch.status != BatchStatus.CANCELLING:
        return False
    drain_batch(s, batch_id, "batch_cancelled", now)
    return True


def expire_batch(s: Session, batch_id: str, now: Optional[float] = None) -> bool:
    """A batch past its completion window: mark it expiring (finalizing with expired_at set) and
    drain its unrun requests with ``batch_expired``. Finalize then writes the partial results."""
    now = time.time() if now is None else now
    res = s.execute(update(Batch).where(Batch.id == batch_id,
                                        Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
                                        Batch.expires_at < now)
                    .values(status=BatchStatus.FINALIZING, finalizing_at=now, expired_at=now, last_enqueued_at=now))
    if res.rowcount != 1:
        return False
    drain_batch(s, batch_id, "batch_expired", now)
    return True


def due_for_expiry(s: Session, now: Optional[float] = None) -> list[str]:
    now = time.time() if now is None else now
    return list(s.scalars(select(Batch.id).where(Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
                                                 Batch.expires_at < now)))


def batch_status(s: Session, batch_id: str) -> str:
    """The batch's status as committed or as this transaction changed it."""
    return s.get(Batch, batch_id, populate_existing=True).status


def final_status(batch: Batch) -> str:
    """The terminal status finalize moves a batch to."""
    if batch.cancelling_at is not None:
        return BatchStatus.CANCELLED
    if batch.expired_at is not None:
        return BatchStatus.EXPIRED
    return BatchStatus.COMPLETED

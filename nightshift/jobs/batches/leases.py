"""Shard leases and compare-and-set result writes (docs/architecture.md, "Exactly once").

A worker claims a shard by a conditional UPDATE that hands it a fresh ``lease_token``.
Every write of results first re-asserts the lease (UPDATE shards ... WHERE lease_token =
:tok, which also takes the shard row lock until commit) and then moves each request with
``WHERE status = 'pending'``. A stale worker whose lease was reclaimed or revoked (cancel,
expiry) changes nothing and learns it lost the lease; a re-run shard skips done requests.

Each function works in the caller's transaction; the guarantees hold per transaction, so a
caller commits after each call (the shard runner does: ``nightshift.workers.shard_stream``).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sqlalchemy import and_, bindparam, exists, func, or_, select, true, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard, ShardStatus


class LeaseLost(RuntimeError):
    """The shard's lease token changed: another attempt owns it, or the batch was cancelled/expired."""


@dataclass(frozen=True)
class Lease:
    shard_id: int
    batch_id: str
    token: str
    owner: str
    attempt: int
    started_at: float


@dataclass
class RequestResult:
    """The terminal outcome of one request, as written to its row."""

    request_id: int
    status: str                                   # RequestStatus.COMPLETED | FAILED
    response_status_code: Optional[int] = None
    response_body: Optional[dict[str, Any]] = None
    error_code: Optional[str] = None
    error_message: Optional[str] = None
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    engine_seconds: float = 0.0
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None


def claim_shard(s: Session, shard_id: int, owner: str, lease_seconds: float, *, device: Optional[str] = None,
                now: Optional[float] = None) -> Optional[Lease]:
    """Lease a pending shard (or one whose lease expired) of an in-progress batch; None if not claimable."""
    now = time.time() if now is None else now
    token = secrets.token_hex(16)
    batch_running = exists().where(Batch.id == Shard.batch_id, Batch.status == BatchStatus.IN_PROGRESS)
    row = s.execute(
        update(Shard)
        .where(Shard.id == shard_id, batch_running,
               or_(Shard.status == ShardStatus.PENDING,
                   and_(Shard.status == ShardStatus.RUNNING, Shard.lease_expires_at < now)))
        .values(status=ShardStatus.RUNNING, lease_owner=owner, lease_token=token,
                lease_expires_at=now + lease_seconds, heartbeat_at=now, attempt=Shard.attempt + 1,
                started_at=func.coalesce(Shard.started_at, now), worker=owner, device=device)
        .returning(Shard.batch_id, Shard.attempt)
    ).first()
    if row is None:
        return None
    return Lease(shard_id, row.batch_id, token, owner, row.attempt, now)


def shard_endpoint(s: Session, shard_id: int) -> Optional[str]:
    """The endpoint of the shard's batch (which engine runs it); None if there is no such shard."""
    return s.scalar(select(Batch.endpoint).join(Shard, Shard.batch_id == Batch.id).where(Shard.id == shard_id))


def renew_lease(s: Session, lease: Lease, lease_seconds: float, now: Optional[float] = None) -> None:
    """Extend the lease (the heartbeat); raises LeaseLost if it is no longer held."""
    now = time.time() if now is None else now
    res = s.execute(update(Shard).where(Shard.id == lease.shard_id, Shard.lease_token == lease.token,
                                        Shard.status == ShardStatus.RUNNING)
                    .values(heartbeat_at=now, lease_expires_at=now + lease_seconds))
    if res.rowcount != 1:
        raise LeaseLost(f"shard {lease.shard_id}: lease {lease.token[:8]} is no longer held")


def claim_next_shard(s: Session, owner: str, lease_seconds: float, *, waiting_since: float,
                     device: Optional[str] = None, now: Optional[float] = None,
                     endpoints: Optional[Sequence[str]] = None) -> Optional[Lease]:
    """Lease the oldest pending shard (oldest batch first) whose wake-up was sent before
    ``waiting_since``: work no idle worker picked up, which a busy worker may take ahead so its
    engine stays full. None if there is none. ``endpoints``: only shards of batches of these
    endpoints (those the caller's engine runs). Postgres skips shards another claimer has
    locked; SQLite's writers take turns anyway."""
    now = time.time() if now is None else now
    candidate = (select(Shard.id).join(Batch, Batch.id == Shard.batch_id)
                 .where(Shard.status == ShardStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS,
                        func.coalesce(Shard.enqueued_at, 0) < waiting_since,
                        Batch.endpoint.in_(endpoints) if endpoints is not None else true())
                 .order_by(Batch.created_at, Shard.batch_id, Shard.seq).limit(1)
                 .with_for_update(of=Shard, skip_locked=True))
    shard_id = s.scalar(candidate)
    return None if shard_id is None else claim_shard(s, shard_id, owner, lease_seconds, device=device, now=now)


_RESULT_COLUMNS = ("status", "response_status_code", "response_body", "error_code", "error_message", "finish_reason",
                   "prompt_tokens", "cached_tokens", "completion_tokens", "engine_seconds", "first_token_at")
_table = Request.__table__
_WRITE_RESULT = (_table.update()
                 .where(_table.c.id == bindparam("r_id"), _table.c.status == RequestStatus.PENDING)
                 .values({**{_table.c[name]: bindparam(f"r_{name}") for name in _RESULT_COLUMNS},
                          _table.c.finished_at: bindparam("r_finished_at"), _table.c.worker: bindparam("r_worker"),
                          _table.c.device: bindparam("r_device"), _table.c.attempt: bindparam("r_attempt"),
                          _table.c.started_at: bindparam("r_started_at")}))


def write_results(s: Session, lease: Lease, results: list[RequestResult], lease_seconds: float, *,
                  device: Optional[str] = None) -> int:
    """Write terminal results under the lease, in bulk; returns how many rows moved (a request
    already terminal is skipped). Raises LeaseLost, having written nothing, if the lease is gone.

    The lease is re-asserted first, which holds the shard row until commit: a cancel or expiry
    drains the shard's requests only after it, so the pending rows read next stay pending until
    this transaction ends. Those rows are then updated in one executemany, and the shard's
    counters by exactly what moved, in the same transaction."""
    if not results:
        return 0
    now = time.time()
    renew_lease(s, lease, lease_seconds, now)
    by_id = {r.request_id: r for r in results}
    pending = set(s.scalars(select(Request.id).where(Request.id.in_(list(by_id)), Request.shard_id == lease.shard_id,
                                                     Request.status == RequestStatus.PENDING)))
    moving = [r for request_id, r in by_id.items() if request_id in pending]
    if not moving:
        return 0
    s.execute(_WRITE_RESULT, [{"r_id": r.request_id, **{f"r_{name}": getattr(r, name) for name in _RESULT_COLUMNS},
                               "r_finished_at": r.finished_at or now, "r_worker": lease.owner, "r_device": device,
                               "r_attempt": lease.attempt, "r_started_at": lease.started_at} for r in moving])
    s.execute(update(Shard).where(Shard.id == lease.shard_id).values(
        completed_count=Shard.completed_count + sum(r.status == RequestStatus.COMPLETED for r in moving),
        failed_count=Shard.failed_count + sum(r.status == RequestStatus.FAILED for r in moving),
        prompt_tokens=Shard.prompt_tokens + sum(r.prompt_tokens for r in moving),
        prefix_hit_tokens=Shard.prefix_hit_tokens + sum(r.cached_tokens for r in moving),
        completion_tokens=Shard.completion_tokens + sum(r.completion_tokens for r in moving),
        engine_seconds=Shard.engine_seconds + sum(r.engine_seconds for r in moving)))
    return len(moving)


def pending_requests(s: Session, lease: Lease) -> list[Request]:
    """The shard's requests still to run, in prefix order (ingest inserted them in that order)."""
    return list(s.scalars(select(Request).where(Request.shard_id == lease.shard_id,
                                                Request.status == RequestStatus.PENDING).order_by(Request.id)))


def complete_shard(s: Session, lease: Lease) -> bool:
    """Mark the shard done if the lease still holds and none of its requests is pending."""
    none_pending = ~exists().where(Request.shard_id == Shard.id, Request.status == RequestStatus.PENDING)
    res = s.execute(update(Shard).where(Shard.id == lease.shard_id, Shard.lease_token == lease.token,
                                        Shard.status == ShardStatus.RUNNING, none_pending)
                    .values(status=ShardStatus.DONE, finished_at=time.time(), lease_expires_at=None))
    return res.rowcount == 1


def release_shard(s: Session, lease: Lease, error: str) -> bool:
    """Give the shard back (an exception in the worker): pending again, to be re-run."""
    res = s.execute(update(Shard).where(Shard.id == lease.shard_id, Shard.lease_token == lease.token,
                                        Shard.status == ShardStatus.RUNNING)
                    .values(status=ShardStatus.PENDING, lease_token=None, lease_expires_at=None,
                            last_error=error[:4000]))
    return res.rowcount == 1

"""Shard leases and compare-and-set result writes (docs/architecture.md, "Exactly once").

A worker claims a shard by a conditional UPDATE that hands it a fresh ``lease_token``.
Every write of results first re-asserts the lease (UPDATE shards ... WHERE lease_token =
:tok, which also takes the shard row lock until commit) and then moves each request with
``WHERE status = 'pending'``. A stale worker whose lease was reclaimed or revoked (cancel,
expiry) changes nothing and learns it lost the lease; a re-run shard skips done requests.

Each function works in the caller's transaction; the guarantees hold per transaction, so a
caller commits after each call (the shard runner does: ``nightshift.workers.shard_runner``).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy import and_, exists, func, or_, select, update
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


def renew_lease(s: Session, lease: Lease, lease_seconds: float, now: Optional[float] = None) -> None:
    """Extend the lease (the heartbeat); raises LeaseLost if it is no longer held."""
    now = time.time() if now is None else now
    res = s.execute(update(Shard).where(Shard.id == lease.shard_id, Shard.lease_token == lease.token,
                                        Shard.status == ShardStatus.RUNNING)
                    .values(heartbeat_at=now, lease_expires_at=now + lease_seconds))
    if res.rowcount != 1:
        raise LeaseLost(f"shard {lease.shard_id}: lease {lease.token[:8]} is no longer held")


def write_results(s: Session, lease: Lease, results: list[RequestResult], lease_seconds: float, *,
                  device: Optional[str] = None) -> int:
    """Write terminal results under the lease; returns how many rows moved (a request already
    terminal is skipped). Raises LeaseLost, having written nothing, if the lease is gone: the
    caller's transaction then rolls back."""
    if not results:
        return 0
    now = time.time()
    written = completed = failed = prompt = cached = completion = 0
    engine_seconds = 0.0
    renew_lease(s, lease, lease_seconds, now)
    for r in results:
        res = s.execute(
            update(Request)
            .where(Request.id == r.request_id, Request.shard_id == lease.shard_id,
                   Request.status == RequestStatus.PENDING)
            .values(status=r.status, response_status_code=r.response_status_code, response_body=r.response_body,
                    error_code=r.error_code, error_message=r.error_message, finish_reason=r.finish_reason,
                    prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                    completion_tokens=r.completion_tokens, engine_seconds=r.engine_seconds,
                    worker=lease.owner, device=device, attempt=lease.attempt, started_at=lease.started_at,
                    first_token_at=r.first_token_at, finished_at=r.finished_at or now))
        if res.rowcount != 1:
            continue
        written += 1
        completed += r.status == RequestStatus.COMPLETED
        failed += r.status == RequestStatus.FAILED
        prompt += r.prompt_tokens
        cached += r.cached_tokens
        completion += r.completion_tokens
        engine_seconds += r.engine_seconds
    if written:
        s.execute(update(Shard).where(Shard.id == lease.shard_id).values(
            completed_count=Shard.completed_count + completed, failed_count=Shard.failed_count + failed,
            prompt_tokens=Shard.prompt_tokens + prompt, prefix_hit_tokens=Shard.prefix_hit_tokens + cached,
            completion_tokens=Shard.completion_tokens + completion,
            engine_seconds=Shard.engine_seconds + engine_seconds))
    return written


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

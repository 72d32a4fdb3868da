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
from functools import lru_cache
from typing import Any, Optional, Sequence

from sqlalchemy import Row, and_, bindparam, exists, func, or_, select, true, update
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


# The statements a shard stream runs many times a second are built once, as Core statements
# with bind parameters: no per-call expression building, no ORM bulk-update evaluation, and
# their compiled forms are cached. (None of them needs the ORM objects of a session updated.)
_shards, _batches, _requests = Shard.__table__, Batch.__table__, Request.__table__
_CLAIM = (_shards.update()
          .where(_shards.c.id == bindparam("s_id"),
                 exists().where(_batches.c.id == _shards.c.batch_id, _batches.c.status == BatchStatus.IN_PROGRESS),
                 or_(_shards.c.status == ShardStatus.PENDING,
                     and_(_shards.c.status == ShardStatus.RUNNING, _shards.c.lease_expires_at < bindparam("s_now"))))
          .values(status=ShardStatus.RUNNING, lease_owner=bindparam("s_owner"), lease_token=bindparam("s_token"),
                  lease_expires_at=bindparam("s_expires"), heartbeat_at=bindparam("s_now"),
                  attempt=_shards.c.attempt + 1, started_at=func.coalesce(_shards.c.started_at, bindparam("s_now")),
                  worker=bindparam("s_owner"), device=bindparam("s_device"),
                  load_error=None, unavailable_since=None)   # its model loaded: no longer waiting on it
          .returning(_shards.c.batch_id, _shards.c.attempt))
_RENEW = (_shards.update()
          .where(_shards.c.id == bindparam("s_id"), _shards.c.lease_token == bindparam("s_token"),
                 _shards.c.status == ShardStatus.RUNNING)
          .values(heartbeat_at=bindparam("s_now"), lease_expires_at=bindparam("s_expires")))
_PENDING_IDS = (select(_requests.c.id)
                .where(_requests.c.id.in_(bindparam("r_ids", expanding=True)),
                       _requests.c.shard_id == bindparam("s_id"), _requests.c.status == RequestStatus.PENDING))
_ADD_COUNTS = (_shards.update().where(_shards.c.id == bindparam("s_id"))
               .values({_shards.c[name]: _shards.c[name] + bindparam(f"s_{name}")
                        for name in ("completed_count", "failed_count", "prompt_tokens", "prefix_hit_tokens",
                                     "completion_tokens", "engine_seconds")}))
_PENDING_ROWS = (select(_requests.c.id, _requests.c.line, _requests.c.custom_id, _requests.c.body,
                        _requests.c.prompt_token_ids)
                 .where(_requests.c.shard_id == bindparam("s_id"), _requests.c.status == RequestStatus.PENDING)
                 .order_by(_requests.c.id))
_COMPLETE = (_shards.update()
             .where(_shards.c.id == bindparam("s_id"), _shards.c.lease_token == bindparam("s_token"),
                    _shards.c.status == ShardStatus.RUNNING,
                    ~exists().where(_requests.c.shard_id == _shards.c.id, _requests.c.status == RequestStatus.PENDING))
             .values(status=ShardStatus.DONE, finished_at=bindparam("s_now"), lease_expires_at=None))


def claim_shard(s: Session, shard_id: int, owner: str, lease_seconds: float, *, device: Optional[str] = None,
                now: Optional[float] = None) -> Optional[Lease]:
    """Lease a pending shard (or one whose lease expired) of an in-progress batch; None if not claimable."""
    now = time.time() if now is None else now
    token = secrets.token_hex(16)
    row = s.execute(_CLAIM, {"s_id": shard_id, "s_now": now, "s_owner": owner, "s_token": token,
                             "s_expires": now + lease_seconds, "s_device": device}).first()
    if row is None:
        return None
    return Lease(shard_id, row.batch_id, token, owner, row.attempt, now)


def shard_endpoint(s: Session, shard_id: int) -> Optional[str]:
    """The endpoint of the shard's batch (which engine runs it); None if there is no such shard."""
    return s.scalar(select(Batch.endpoint).join(Shard, Shard.batch_id == Batch.id).where(Shard.id == shard_id))


def renew_lease(s: Session, lease: Lease, lease_seconds: float, now: Optional[float] = None) -> None:
    """Extend the lease (the heartbeat); raises LeaseLost if it is no longer held."""
    now = time.time() if now is None else now
    res = s.execute(_RENEW, {"s_id": lease.shard_id, "s_token": lease.token, "s_now": now,
                             "s_expires": now + lease_seconds})
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
    shard_id = s.scalar(_next_pending_shard(tuple(endpoints) if endpoints is not None else None),
                        {"s_waiting_since": waiting_since})
    return None if shard_id is None else claim_shard(s, shard_id, owner, lease_seconds, device=device, now=now)


@lru_cache(maxsize=8)
def _next_pending_shard(endpoints: Optional[tuple[str, ...]]):  # noqa: ANN202 - a Select
    return (select(_shards.c.id).join(_batches, _batches.c.id == _shards.c.batch_id)
            .where(_shards.c.status == ShardStatus.PENDING, _batches.c.status == BatchStatus.IN_PROGRESS,
                   func.coalesce(_shards.c.enqueued_at, 0) < bindparam("s_waiting_since"),
                   _batches.c.endpoint.in_(endpoints) if endpoints is not None else true())
            .order_by(_batches.c.created_at, _shards.c.batch_id, _shards.c.seq).limit(1)
            .with_for_update(of=_shards, skip_locked=True))


_RESULT_COLUMNS = ("status", "response_status_code", "response_body", "error_code", "error_message", "finish_reason",
                   "prompt_tokens", "cached_tokens", "completion_tokens", "engine_seconds", "first_token_at")
_WRITE_RESULT = (_requests.update()
                 .where(_requests.c.id == bindparam("r_id"), _requests.c.status == RequestStatus.PENDING)
                 .values({**{_requests.c[name]: bindparam(f"r_{name}") for name in _RESULT_COLUMNS},
                          _requests.c.finished_at: bindparam("r_finished_at"),
                          _requests.c.worker: bindparam("r_worker"), _requests.c.device: bindparam("r_device"),
                          _requests.c.attempt: bindparam("r_attempt"),
                          _requests.c.started_at: bindparam("r_started_at")}))


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
    pending = set(s.scalars(_PENDING_IDS, {"r_ids": list(by_id), "s_id": lease.shard_id}))
    moving = [r for request_id, r in by_id.items() if request_id in pending]
    if not moving:
        return 0
    s.execute(_WRITE_RESULT, [{"r_id": r.request_id, **{f"r_{name}": getattr(r, name) for name in _RESULT_COLUMNS},
                               "r_finished_at": r.finished_at or now, "r_worker": lease.owner, "r_device": device,
                               "r_attempt": lease.attempt, "r_started_at": lease.started_at} for r in moving])
    s.execute(_ADD_COUNTS, {"s_id": lease.shard_id,
                            "s_completed_count": sum(r.status == RequestStatus.COMPLETED for r in moving),
                            "s_failed_count": sum(r.status == RequestStatus.FAILED for r in moving),
                            "s_prompt_tokens": sum(r.prompt_tokens for r in moving),
                            "s_prefix_hit_tokens": sum(r.cached_tokens for r in moving),
                            "s_completion_tokens": sum(r.completion_tokens for r in moving),
                            "s_engine_seconds": sum(r.engine_seconds for r in moving)})
    return len(moving)


def pending_requests(s: Session, lease: Lease) -> list[Row]:
    """The shard's requests still to run (id, line, custom_id, body, prompt_token_ids), in prefix
    order (ingest inserted them in that order)."""
    return list(s.execute(_PENDING_ROWS, {"s_id": lease.shard_id}))


def complete_shard(s: Session, lease: Lease) -> bool:
    """Mark the shard done if the lease still holds and none of its requests is pending."""
    res = s.execute(_COMPLETE, {"s_id": lease.shard_id, "s_token": lease.token, "s_now": time.time()})
    return res.rowcount == 1


def release_shard(s: Session, lease: Lease, error: str) -> bool:
    """Give the shard back (an exception in the worker): pending again, to be re-run."""
    res = s.execute(update(Shard).where(Shard.id == lease.shard_id, Shard.lease_token == lease.token,
                                        Shard.status == ShardStatus.RUNNING)
                    .values(status=ShardStatus.PENDING, lease_token=None, lease_expires_at=None,
                            last_error=error[:4000]))
    return res.rowcount == 1

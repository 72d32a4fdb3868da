"""The engine hosts table's writes (by the engine workers) and reads (validation, the reconciler).

An engine worker registers each kind of model it runs when its process starts (state
``starting``: engines load lazily, on the first shard), marks it ``ready`` or ``failed`` after
each load attempt, and renews ``heartbeat_at`` every ``engine_host_heartbeat_seconds``; a row
whose heartbeat is older than ``engine_host_stale_seconds`` is a dead worker's and counts for
nothing. Functions take the caller's session (the caller commits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.engine_hosts.models import EngineHost, HostState

CHAT, EMBEDDINGS = "chat", "embeddings"      # the kinds of model a worker runs


def register(s: Session, worker: str, kind: str, model: str, names: Iterable[str], now: float) -> None:
    """(Re)register this worker's model of ``kind``: starting, nothing loaded yet."""
    row = s.get(EngineHost, (worker, kind))
    if row is None:
        s.add(EngineHost(worker=worker, kind=kind, model=model, names=sorted(set(names)), state=HostState.STARTING,
                         failures=0, started_at=now, heartbeat_at=now))
    else:
        row.model, row.names, row.state, row.error, row.failures, row.retry_at = \
            model, sorted(set(names)), HostState.STARTING, None, 0, None
        row.started_at = row.heartbeat_at = now


def heartbeat(s: Session, worker: str, now: float) -> int:
    """Renew the worker's rows; how many there were (0: they are gone, register again)."""
    return s.execute(update(EngineHost).where(EngineHost.worker == worker).values(heartbeat_at=now)).rowcount


def mark_ready(s: Session, worker: str, kind: str, now: float) -> None:
    s.execute(update(EngineHost).where(EngineHost.worker == worker, EngineHost.kind == kind)
              .values(state=HostState.READY, error=None, failures=0, retry_at=None, heartbeat_at=now))


def mark_failed(s: Session, worker: str, kind: str, error: str, failures: int, retry_at: float, now: float) -> None:
    s.execute(update(EngineHost).where(EngineHost.worker == worker, EngineHost.kind == kind)
              .values(state=HostState.FAILED, error=error, failures=failures, retry_at=retry_at, heartbeat_at=now))


def unregister(s: Session, worker: str) -> None:
    s.execute(delete(EngineHost).where(EngineHost.worker == worker))


@dataclass(frozen=True)
class LiveHost:
    worker: str
    model: str
    names: tuple[str, ...]
    state: str
    error: Optional[str]


def live_hosts(s: Session, kind: str, now: float, stale_seconds: float) -> list[LiveHost]:
    """The rows of ``kind`` whose worker heart-beat within ``stale_seconds``."""
    rows = s.execute(select(EngineHost.worker, EngineHost.model, EngineHost.names, EngineHost.state, EngineHost.error)
                     .where(EngineHost.kind == kind, EngineHost.heartbeat_at >= now - stale_seconds)
                     .order_by(EngineHost.worker)).all()
    return [LiveHost(r.worker, r.model, tuple(r.names or ()), r.state, r.error) for r in rows]


def served_names(s: Session, kind: str, now: float, stale_seconds: float) -> Optional[set[str]]:
    """The model names live workers of ``kind`` serve; None when no worker of that kind is alive
    (a cold start: the caller falls back to its own settings)."""
    hosts = live_hosts(s, kind, now, stale_seconds)
    return None if not hosts else {name for host in hosts for name in host.names}


@dataclass(frozen=True)
class SeenHost:
    worker: str
    kind: str
    model: str
    state: str
    error: Optional[str]
    started_at: float
    heartbeat_at: float
    alive: bool                  # heart-beat within the stale limit


def hosts_seen(s: Session, now: float, stale_seconds: float, since_seconds: float) -> list[SeenHost]:
    """Every engine worker row that heart-beat within ``since_seconds`` (alive or lately gone),
    the live ones first."""
    rows = s.execute(select(EngineHost).where(EngineHost.heartbeat_at >= now - since_seconds)
                     .order_by(EngineHost.heartbeat_at.desc(), EngineHost.worker, EngineHost.kind)).scalars()
    hosts = [SeenHost(r.worker, r.kind, r.model, r.state, r.error, r.started_at, r.heartbeat_at,
                      r.heartbeat_at >= now - stale_seconds) for r in rows]
    return sorted(hosts, key=lambda h: not h.alive)

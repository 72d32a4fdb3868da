"""How request handlers reach the database: one worker-thread call per unit of work, with
the session opened, committed (or rolled back) and closed inside that call.

Why not a ``yield`` session dependency: FastAPI runs a sync generator dependency's exit in
the thread pool too. Under load every pool thread can be waiting for a database connection
while the connections are held by sessions whose exit waits for a free thread: a deadlock
that outlives the burst. Here a connection is taken and given back by the same thread, in
one call that never waits on the thread pool, so a connection is always returned.

Admission: at most ``db_pool_size`` units of work run at once per process, on their own
thread limiter, so they never wait for a pool connection (the pool has exactly that many
and no overflow). Waiting units queue per API key and a freed slot goes to the keys in turn
(api/fair_slots.py), so one key's pile of requests does not delay another key's. A request that cannot get a slot within ``api_queue_seconds`` is answered
503 with ``Retry-After`` (the openai client retries it) instead of queueing without bound;
the slots come back as soon as the burst ends.

Database away (a restart, an outage, a failover): work whose connection cannot be opened or
is lost is answered 503 with ``Retry-After`` (``DatabaseUnavailable``), as fast as the driver
fails: a refused connection (a server stopped or restarting) at once; a server that accepts
nothing (a host gone from the network, a stalled postmaster) after ``db_connect_timeout_seconds``
(libpq's ``connect_timeout``, and ``tcp_user_timeout`` for a connection whose data goes
unacknowledged), never after TCP's minutes. Nothing the work did was committed. The first
request after the database is back gets a fresh connection.

Round trips (Postgres): the API's pool has no pre-ping (a ``SELECT 1`` before every unit of
work). A connection that a database restart closed fails its first statement instead; nothing
was committed then, so the unit of work runs once more on a fresh connection (SQLAlchemy
replaces every connection older than the failure). Read-only work runs in autocommit: no
``BEGIN``/``ROLLBACK`` around it; each statement reads the latest committed data. A poll of a
batch is three round trips: the key, the batch, its progress.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from nightshift.api.fair_slots import REQUEST_KEY, FairSlots
from nightshift.settings import Settings
from nightshift.storage.db import READ_ONLY, make_engine

T = TypeVar("T")
log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Every database slot stayed busy for the whole admission wait (the API answers 503)."""

    def __init__(self, retry_after_seconds: int):
        super().__init__("The server is busy; retry after a short wait.")
        self.retry_after_seconds = retry_after_seconds


class DatabaseUnavailable(Exception):
    """The database could not be reached, or the connection was lost mid-work (the API answers 503)."""

    def __init__(self, retry_after_seconds: int, reason: str):
        super().__init__("The database is unavailable; retry after a short wait.")
        self.retry_after_seconds = retry_after_seconds
        self.reason = reason


def database_away(exc: BaseException) -> bool:
    """Whether a database error means the server is away (refused, closed, shutting down or
    starting up), not that the work was wrong."""
    return isinstance(exc, (OperationalError, InterfaceError)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated)


class _ClosedConnection(Exception):
    """The work's connection turned out closed before anything was committed."""


class RequestDatabase:
    """Runs request handlers' database work with bounded concurrency and a bounded wait."""

    def __init__(self, settings: Settings):
        self.url = settings.resolved_database_url
        self.slots = settings.db_pool_size
        self.queue_seconds = settings.api_queue_seconds
        self.retry_after_seconds = settings.api_retry_after_seconds
        self._admission = FairSlots(self.slots)
        self._threads = anyio.CapacityLimiter(self.slots)
        self.engine = make_engine(self.url, self.slots, settings.db_pool_timeout_seconds, pre_ping=False,
                                  connect_timeout=settings.db_connect_timeout_seconds)
        read_options = {READ_ONLY: True}
        if self.engine.dialect.name == "postgresql":
            read_options["isolation_level"] = "AUTOCOMMIT"
        self._binds = {False: self.engine, True: self.engine.execution_options(**read_options)}
        self._unavailable_logged_at = -1e9

    def close(self) -> None:
        self.engine.dispose()

    def open_connections(self) -> None:
        """Open the pool's connections at start (Postgres), so that the first burst of requests
        does not open them all at once: a Postgres connection costs the server a process start,
        and with eight at once another key's poll waited 100-300 ms behind them (bench.api_load
        --hammer). Best effort: a database away at start is reported by the first request."""
        if self.engine.dialect.name != "postgresql":
            return
        connections = []
        try:
            for _ in range(self.slots):
                connections.append(self.engine.connect())
        except DBAPIError as exc:
            log.warning("could not open the database connections at start (%s); they open on demand",
                        type(exc.orig or exc).__name__)
        finally:
            for connection in connections:
                connection.close()

    async def run(self, work: Callable[[Session], T], *, read_only: bool = False) -> T:
        """``work(session)`` in a worker thread; the session commits if it returns, rolls back
        if it raises, and is closed before the thread is released. ``read_only`` work does not
        take SQLite's write lock (Postgres runs it the same either way)."""
        admitted = False
        with anyio.move_on_after(self.queue_seconds):
            await self._admission.acquire(REQUEST_KEY.get())
            admitted = True
        if not admitted:
            raise Overloaded(self.retry_after_seconds)
        try:
            # Not abandoned on cancellation: the slot is released only when the thread is done.
            return await anyio.to_thread.run_sync(self._in_session, work, read_only, limiter=self._threads)
        except DBAPIError as exc:
            if database_away(exc):
                self._note_unavailable(exc)
                raise DatabaseUnavailable(self.retry_after_seconds, type(exc.orig or exc).__name__) from exc
            raise
        finally:
            self._admission.release()

    def _note_unavailable(self, exc: DBAPIError) -> None:
        """One warning per outage (then at most one a minute), not one per request."""
        now = time.monotonic()
        if now - self._unavailable_logged_at >= 60:
            self._unavailable_logged_at = now
            reason = str(exc.orig or exc).strip().splitlines()
            log.warning("database unavailable, answering 503 with Retry-After: %s", reason[0] if reason else exc)

    def _in_session(self, work: Callable[[Session], T], read_only: bool) -> T:
        try:
            return self._attempt(work, read_only, may_retry=True)
        except _ClosedConnection as closed:
            log.warning("a pooled database connection was closed (%s); running the work again on a new one",
                        closed.__cause__.orig)
            return self._attempt(work, read_only, may_retry=False)

    def _attempt(self, work: Callable[[Session], T], read_only: bool, may_retry: bool) -> T:
        session = Session(bind=self._binds[read_only], expire_on_commit=False)
        try:
            try:
                result = work(session)
            except DBAPIError as exc:
                if may_retry and exc.connection_invalidated:   # before the commit: nothing was written
                    raise _ClosedConnection() from exc
                raise
            if not read_only:
                session.commit()
            return result
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @property
    def busy(self) -> int:
        return self.slots - self._admission.value


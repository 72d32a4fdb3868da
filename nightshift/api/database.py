"""How request handlers reach the database: one worker-thread call per unit of work, with
the session opened, committed (or rolled back) and closed inside that call.

Why not a ``yield`` session dependency: FastAPI runs a sync generator dependency's exit in
the thread pool too. Under load every pool thread can be waiting for a database connection
while the connections are held by sessions whose exit waits for a free thread: a deadlock
that outlives the burst. Here a connection is taken and given back by the same thread, in
one call that never waits on the thread pool, so a connection is always returned.

Admission: at most ``db_pool_size`` units of work run at once per process, on their own
thread limiter, so they never wait for a pool connection (the pool has exactly that many
and no overflow). A request that cannot get a slot within ``api_queue_seconds`` is answered
503 with ``Retry-After`` (the openai client retries it) instead of queueing without bound;
the slots come back as soon as the burst ends.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.orm import Session

from nightshift.settings import Settings
from nightshift.storage.db import read_only_session_scope, session_scope

T = TypeVar("T")


class Overloaded(Exception):
    """Every database slot stayed busy for the whole admission wait (the API answers 503)."""

    def __init__(self, retry_after_seconds: int):
        super().__init__("The server is busy; retry after a short wait.")
        self.retry_after_seconds = retry_after_seconds


class RequestDatabase:
    """Runs request handlers' database work with bounded concurrency and a bounded wait."""

    def __init__(self, settings: Settings):
        self.url = settings.resolved_database_url
        self.slots = settings.db_pool_size
        self.queue_seconds = settings.api_queue_seconds
        self.retry_after_seconds = settings.api_retry_after_seconds
        self._admission = anyio.Semaphore(self.slots)
        self._threads = anyio.CapacityLimiter(self.slots)

    async def run(self, work: Callable[[Session], T], *, read_only: bool = False) -> T:
        """``work(session)`` in a worker thread; the session commits if it returns, rolls back
        if it raises, and is closed before the thread is released. ``read_only`` work does not
        take SQLite's write lock (Postgres runs it the same either way)."""
        admitted = False
        with anyio.move_on_after(self.queue_seconds):
            await self._admission.acquire()
            admitted = True
        if not admitted:
            raise Overloaded(self.retry_after_seconds)
        try:
            # Not abandoned on cancellation: the slot is released only when the thread is done.
            return await anyio.to_thread.run_sync(self._in_session, work, read_only, limiter=self._threads)
        finally:
            self._admission.release()

    def _in_session(self, work: Callable[[Session], T], read_only: bool) -> T:
        scope = read_only_session_scope if read_only else session_scope
        with scope(self.url) as session:
            return work(session)

    @property
    def busy(self) -> int:
        return self.slots - self._admission.value


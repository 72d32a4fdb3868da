"""Database slots handed out fairly across API keys.

The API runs at most ``db_pool_size`` units of database work at once per process
(api/database.py). A plain semaphore queues the waiters first come, first served: a key with 16
requests waiting puts another key's one request behind all 16. Here each key waits in a queue of
its own, and a freed slot goes to the next key in turn (round robin): the lone request of a
polite key waits for one slot to free, whatever a busy key has queued.

``REQUEST_KEY`` names whose work it is: api/rate_limits.py sets it (the key's hash) for each
request it lets in; work outside a request (or without a bearer token) shares the key ``""``.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from contextvars import ContextVar

REQUEST_KEY: ContextVar[str] = ContextVar("nightshift_request_key", default="")


class FairSlots:
    """At most ``slots`` holders at once; waiters queue per key and are served round robin.
    Used from one event loop (each API worker process has its own)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.value = slots                                   # free slots
        self._queues: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def acquire(self, key: str) -> None:
        if self.value > 0 and not self._queues:
            self.value -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(waiter)
        try:
            await waiter
        except BaseException:                               # cancelled (the admission wait ran out)
            if waiter.done() and not waiter.cancelled():
                self.release()                               # the slot was handed over as it was cancelled
            else:
                self._forget(key, waiter)
            raise

    def release(self) -> None:
        """Hand the slot to the first waiter of the next key in turn, or free it."""
        while self._queues:
            key, queue = next(iter(self._queues.items()))
            waiter = queue.popleft()
            if queue:
                self._queues.move_to_end(key)                # the key's next waiter goes behind the others
            else:
                del self._queues[key]
            if not waiter.done():
                waiter.set_result(None)
                return
        self.value += 1

    def _forget(self, key: str, waiter: asyncio.Future) -> None:
        queue = self._queues.get(key)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del self._queues[key]

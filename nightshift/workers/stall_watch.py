"""Every thread's stack in the engine worker's log when its task stops moving.

An engine task that hangs (a deadlock in a kernel or between threads, a model load that never
returns) holds its worker and, while its database thread still renews the leases, its shards,
and says nothing about where it stands. ``StallWatch`` arms Python's faulthandler watchdog for
``engine_stall_seconds`` (a C thread: it writes while the hung thread holds the GIL); a chat
engine re-arms it at each step (a step listener), so only a load or a step that takes longer
than that writes the stacks of all threads to the worker's stderr, which is its log, and again
every ``engine_stall_seconds`` while it lasts. An embeddings run has no steps to report: a run
of one longer than that writes the stacks too. Diagnosis only: nothing is stopped. Re-arming
costs ~50 us (faulthandler starts a new watchdog thread), so a step re-arms it only once a tenth
of its seconds (at most one second) has passed since the last time: a GPU decode step of a few
milliseconds pays nothing measurable, and a stall is reported at most that much late.
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import time
from typing import IO, Iterator, Optional


class StallWatch:
    def __init__(self, seconds: float, file: Optional[IO] = None):
        self.seconds = seconds
        self.file = file if file is not None else sys.__stderr__   # the process's own stderr (Celery proxies sys.stderr)
        self.armed_at = float("-inf")
        self.every = min(1.0, seconds / 10)

    def arm(self, *_: object) -> None:
        """(Re)start the countdown, unless it was restarted less than ``every`` seconds ago;
        takes and ignores a step listener's StepReport."""
        now = time.monotonic()
        if self.seconds > 0 and now - self.armed_at >= self.every:
            faulthandler.dump_traceback_later(self.seconds, repeat=True, file=self.file)
            self.armed_at = now

    def __enter__(self) -> "StallWatch":
        self.armed_at = float("-inf")
        self.arm()
        return self

    def __exit__(self, *_: object) -> None:
        faulthandler.cancel_dump_traceback_later()

    @contextlib.contextmanager
    def steps_of(self, engine) -> Iterator[None]:  # noqa: ANN001
        """Re-armed at each step of ``engine`` while inside (an engine without step listeners:
        the countdown runs on)."""
        listeners = getattr(engine, "step_listeners", None)
        if listeners is None:
            yield
            return
        listeners.append(self.arm)
        try:
            yield
        finally:
            listeners.remove(self.arm)

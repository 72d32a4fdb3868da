"""Every thread's stack in the engine worker's log when its task stops moving.

An engine task that hangs (a deadlock in a kernel or between threads, a model load that never
returns) holds its worker and, while its database thread still renews the leases, its shards,
and says nothing about where it stands. ``StallWatch`` runs a watchdog thread for
``engine_stall_seconds``: a chat engine re-arms it at each step (a step listener: one clock read),
so only a load or a step that takes longer than that writes the stacks of all threads to the
worker's stderr, which is its log, and again every ``engine_stall_seconds`` while it lasts. An
embeddings run has no steps to report: a run of one longer than that writes the stacks too.
Diagnosis only: nothing is stopped.

The watchdog is a Python thread and reads the stacks with the GIL held (``sys._current_frames``),
so it reads them whole while the other threads run on. A task slow but alive (a long load, a
long step) is the common case, and Python's faulthandler cannot read it safely: its C watchdog
walks the frames of threads that are changing them (in the engine worker it wrote empty stacks,
and once it crashed the worker with SIGSEGV, so the task ran again). A hang that holds the GIL
(a C call that never returns without releasing it) would keep the Python watchdog from running:
for that one, faulthandler is armed too, for twice the seconds, and pushed back by the Python
watchdog every half of its seconds, so it writes only when the Python watchdog has been kept from
running that long, when no thread's frames move.
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import traceback
from typing import IO, Iterator, Optional


class StallWatch:
    def __init__(self, seconds: float, file: Optional[IO] = None):
        self.seconds = seconds
        self.file = file if file is not None else sys.__stderr__   # the process's own stderr (Celery proxies sys.stderr)
        self.armed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self, *_: object) -> None:
        """Restart the countdown; takes and ignores a step listener's StepReport."""
        self.armed_at = time.monotonic()

    def __enter__(self) -> "StallWatch":
        self.arm()
        if self.seconds > 0:
            self._stop.clear()
            self._push_back_fallback()
            self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)      # a write blocked on a full pipe must not hold the task
            self._thread = None
            faulthandler.cancel_dump_traceback_later()

    def _push_back_fallback(self) -> None:
        """faulthandler's watchdog for a hang that holds the GIL (it writes only if this is not
        called again within twice the seconds)."""
        faulthandler.dump_traceback_later(2 * self.seconds, repeat=True, file=self.file)

    def _watch(self) -> None:
        written_at = float("-inf")
        while True:
            due = max(self.armed_at, written_at) + self.seconds      # again every seconds while it lasts
            if self._stop.wait(min(self.seconds / 2, max(0.0, due - time.monotonic()))):
                return
            self._push_back_fallback()
            now = time.monotonic()
            if now >= max(self.armed_at, written_at) + self.seconds:
                try:
                    self._write(now - self.armed_at)
                except (OSError, ValueError):     # a closed or full log: the watch (and its push-backs) go on
                    pass
                written_at = now

    def _write(self, quiet: float) -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = [f"Stall: no progress for {quiet:.1f} s; every thread's stack (most recent call first):"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            lines.append(f"Thread 0x{ident:016x} ({names.get(ident, '?')}) (most recent call first):")
            for f, lineno in traceback.walk_stack(frame):        # most recent first, no source read
                lines.append(f'  File "{f.f_code.co_filename}", line {lineno} in {f.f_code.co_name}')
            lines.append("")
        self.file.write("\n".join(lines) + "\n")
        self.file.flush()

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

"""The engine worker's stall watch (workers/stall_watch.py): every thread's stack is written
once nothing re-armed the watch for its seconds, again while it stays stuck, never while
steps keep coming, and never after the watch is left; by faulthandler only when a hang holds
the GIL."""
from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

from nightshift.workers.stall_watch import StallWatch


def hung_in_a_kernel(release: threading.Event) -> None:
    release.wait(10)


def test_a_hang_writes_every_thread_s_stack_and_again_while_it_lasts(tmp_path):
    release = threading.Event()
    hung = threading.Thread(target=hung_in_a_kernel, args=(release,), daemon=True)
    hung.start()
    with open(tmp_path / "log", "w+") as log:
        with StallWatch(0.3, file=log):
            time.sleep(1.0)
        release.set()
        log.seek(0)
        written = log.read()
    assert "hung_in_a_kernel" in written and "most recent call first" in written
    assert written.count("hung_in_a_kernel") >= 2          # repeated while stuck


def test_steps_re_arm_it_and_leaving_it_disarms_it(tmp_path):
    engine = SimpleNamespace(step_listeners=[])
    with open(tmp_path / "log", "w+") as log:
        with StallWatch(0.4, file=log) as watch:
            with watch.steps_of(engine):
                assert engine.step_listeners == [watch.arm]
                for _ in range(10):                         # an engine stepping every 0.1 s
                    time.sleep(0.1)
                    for listener in engine.step_listeners:
                        listener(SimpleNamespace(seconds=0.1))
            assert engine.step_listeners == []
        time.sleep(0.6)                                     # left: nothing more is written
        log.seek(0)
        assert log.read() == ""


def test_zero_seconds_never_writes(tmp_path):
    with open(tmp_path / "log", "w+") as log:
        with StallWatch(0, file=log):
            time.sleep(0.3)
        log.seek(0)
        assert log.read() == ""


def busy_python_work() -> int:
    return sum(range(2000))


def test_a_slow_but_alive_task_is_written_whole_by_the_python_watchdog(tmp_path):
    """A load or step that runs on without a step report (the common stall: slow, not hung): its
    stack is read with the GIL, whole, and faulthandler (the hang-with-the-GIL fallback), pushed
    back all the while, never writes."""
    with open(tmp_path / "log", "w+") as log:
        with StallWatch(0.2, file=log):
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                busy_python_work()
        log.seek(0)
        written = log.read()
    assert "Stall: no progress for" in written and "MainThread" in written
    assert "test_a_slow_but_alive_task_is_written_whole_by_the_python_watchdog" in written
    assert "Timeout (" not in written                       # faulthandler's header


def test_a_hang_holding_the_gil_is_written_by_faulthandler(tmp_path):
    """A C call that keeps the GIL keeps the Python watchdog from running: faulthandler's C
    watchdog, no longer pushed back, writes the stacks (frozen while the GIL is held)."""
    libc = ctypes.PyDLL(None)                               # its calls do not release the GIL
    with open(tmp_path / "log", "w+") as log:
        with StallWatch(0.2, file=log):
            libc.usleep(1_500_000)
        log.seek(0)
        written = log.read()
    assert "Timeout (" in written and "most recent call first" in written
    assert "test_a_hang_holding_the_gil_is_written_by_faulthandler" in written


def test_a_log_that_cannot_be_written_stops_neither_the_watch_nor_its_push_backs(tmp_path):
    """Were the Python watchdog to die on a failed write, faulthandler's fallback would no longer be
    pushed back and would walk the frames of a task that is running."""
    with open(tmp_path / "log", "w+") as log:
        watch = StallWatch(0.2, file=log)
        writes = []

        def failing_write(quiet):
            writes.append(quiet)
            raise OSError("disk full")
        watch._write = failing_write
        with watch:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                busy_python_work()
        log.seek(0)
        assert len(writes) >= 2 and "Timeout (" not in log.read()

"""The engine worker's stall watch (workers/stall_watch.py): every thread's stack is written
once nothing re-armed the watch for its seconds, again while it stays stuck, never while
steps keep coming, and never after the watch is left."""
from __future__ import annotations

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


def test_steps_re_arm_it_at_most_every_tenth_of_its_seconds(monkeypatch, tmp_path):
    """Re-arming starts a watchdog thread (~50 us): a fast engine's steps do it at most once a
    tenth of the seconds (at most once a second)."""
    import faulthandler

    from nightshift.workers import stall_watch
    armed, clock = [], [100.0]
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *a, **k: armed.append(clock[0]))
    monkeypatch.setattr(stall_watch.time, "monotonic", lambda: clock[0])
    with open(tmp_path / "log", "w") as log:
        watch = StallWatch(300, file=log)
        assert watch.every == 1.0 and StallWatch(2, file=log).every == 0.2
        with watch:
            for _ in range(20):                             # a step every 0.25 s for 5 s
                clock[0] += 0.25
                watch.arm()
    assert armed == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]

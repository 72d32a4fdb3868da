"""Worker subprocess helpers for pipeline tests (see workers/procs.py) and a polling wait."""
from __future__ import annotations

import time

from nightshift.workers.procs import kill_group, service_env, start_worker, stop  # noqa: F401


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

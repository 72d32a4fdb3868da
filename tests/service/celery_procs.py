"""Worker subprocess helpers for pipeline tests (see workers/procs.py) and a polling wait."""
from __future__ import annotations

import os
import time

from nightshift.workers import procs
from nightshift.workers.procs import kill_group, start_worker, stop  # noqa: F401

# The engine workers' K/V pool in these tests: 1,024 blocks of 16 positions (~377 MB of bfloat16
# K/V for the default model), room for every test's batch and for one request of the model's
# whole context (512 blocks). Left at its default (a share of the RAM, up to 4 GiB) each worker
# faults its whole pool in at load (cpu_allocator.huge_page_zeros: ~2.2 s for 4.3 GB on a 2-core
# Xeon), in every worker of every test, and two or three such workers hold gigabytes at once.
# A test may pass its own engine_num_kv_blocks; the default pool is what bench.engine runs.
TEST_KV_BLOCKS = 1024

# The tests' Redis server; each test file that uses it has a database number of its own
# (`REDIS_DB`, checked at collection in conftest.py).
REDIS_URL = os.environ.get("NIGHTSHIFT_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def redis_db_url(db: int) -> str:
    return f"{REDIS_URL}/{db}"


def service_env(**nightshift: object) -> dict[str, str]:
    """procs.service_env with the tests' K/V pool (TEST_KV_BLOCKS) unless the test sets its own."""
    return procs.service_env(**{"engine_num_kv_blocks": TEST_KV_BLOCKS, **nightshift})


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

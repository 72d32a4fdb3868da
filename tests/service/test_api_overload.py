"""The API under a polling burst, as a dashboard would hit it: 200 concurrent clients polling
one batch and the batch list with one key. Nothing may hang: every answer is a 200, a 429 (the
key's rate limit, api/rate_limits.py) or a fast 503, each refusal with Retry-After, and the
server answers normally right after the burst. Run against the real
server in both shapes: `nightshift serve` (embedded) and uvicorn with two workers on Postgres."""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest

from .api_fixtures import (Service, free_port, make_key, new_bucket, openai_client, s3_env, service_env,
                           wait_http)
from .test_api_files import jsonl

CLIENTS = 200


@dataclass
class Burst:
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)           # exceptions: timeouts, dropped connections
    slow_503: list = field(default_factory=list)
    missing_retry_after: int = 0

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())


async def _poll(base_url: str, key: str, batch_id: str, seconds: float, max_503_seconds: float) -> Burst:
    # aiohttp: a cheap client, so the burst measures the server rather than the test process.
    burst = Burst()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"},
                                     timeout=aiohttp.ClientTimeout(total=15),
                                     connector=aiohttp.TCPConnector(limit=CLIENTS)) as client:
        async def one_client(i: int) -> None:
            end = time.monotonic() + seconds
            url = f"{base_url}/batches/{batch_id}" if i % 2 else f"{base_url}/batches?limit=20"
            while time.monotonic() < end:
                started = time.monotonic()
                try:
                    async with client.get(url) as response:
                        await response.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    burst.failures.append(repr(exc))
                    continue
                burst.statuses[response.status] = burst.statuses.get(response.status, 0) + 1
                if response.status in (429, 503):
                    burst.missing_retry_after += "retry-after" not in response.headers
                    if time.monotonic() - started > max_503_seconds:
                        burst.slow_503.append(time.monotonic() - started)

        await asyncio.gather(*(one_client(i) for i in range(CLIENTS)))
    return burst


def _new_batch(base_url: str, key: str) -> str:
    client = openai_client(base_url, key)
    f = client.files.create(file=("in.jsonl", jsonl(4)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def _check_burst_and_recovery(base_url: str, key: str, batch_id: str, queue_seconds: float) -> Burst:
    # A 503 must come within the admission wait (plus scheduling slack on a loaded 2-core box).
    burst = asyncio.run(_poll(base_url, key, batch_id, seconds=4, max_503_seconds=queue_seconds + 3))
    assert burst.failures == [], burst.failures[:5]
    assert set(burst.statuses) <= {200, 429, 503}, burst.statuses
    assert burst.statuses.get(200, 0) > 0
    assert burst.missing_retry_after == 0 and burst.slow_503 == [], burst
    started = time.monotonic()
    response = httpx.get(f"{base_url}/batches?limit=1", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    assert response.status_code == 200 and time.monotonic() - started < 1.0
    return burst


@pytest.mark.slow
def test_embedded_serve_survives_polling_burst(tmp_path):
    home = tmp_path / "home"
    port = free_port()
    service = Service(service_env(home, port=port), tmp_path)
    try:
        base_url, key = service.start_serve(port), (home / "api_key").read_text().strip()
        _check_burst_and_recovery(base_url, key, _new_batch(base_url, key), queue_seconds=2.0)
    finally:
        service.stop()


def test_uvicorn_workers_on_postgres_survive_polling_burst(pg_db, s3_server, tmp_path):
    env = service_env(tmp_path, database_url=pg_db, **s3_env(s3_server, new_bucket(s3_server)))
    service = Service(env, tmp_path)
    port = free_port()
    try:
        service.start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory", "--workers", "2",
                              "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{port}/health", service.procs["api"])
        base_url, key = f"http://127.0.0.1:{port}/v1", make_key(pg_db, "dashboard")
        _check_burst_and_recovery(base_url, key, _new_batch(base_url, key), queue_seconds=2.0)
    finally:
        service.stop()


def test_saturated_api_answers_fast_503_with_retry_after(sqlite_db, tmp_path):
    """One database slot and a 50 ms admission wait: most of a 200-client burst is turned away
    at once with 503 + Retry-After, nothing hangs, and the server is normal right after. (No
    rate limit and no cap per key here: what is measured is the database slots' admission.)"""
    env = service_env(tmp_path, database_url=sqlite_db, db_pool_size=1, api_queue_seconds=0.05,
                      rate_limit_key_rps=0, rate_limit_project_rps=0, api_key_inflight=0)
    service = Service(env, tmp_path)
    try:
        base_url = service.start_api(free_port())
        key = make_key(sqlite_db, "dashboard")
        burst = _check_burst_and_recovery(base_url, key, _new_batch(base_url, key), queue_seconds=0.05)
        assert burst.statuses.get(503, 0) > 0, burst.statuses
    finally:
        service.stop()

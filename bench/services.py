"""The service shapes the benchmarks run against, started and removed by the command itself.

- ``embedded``: `nightshift serve` (SQLite, local folder, filesystem broker) in a temp home;
- ``services``: a new Postgres database, a Redis database, moto's S3 server (its own process,
  so it does not share the benchmark's GIL), uvicorn with two workers, one engine worker and
  one cpu worker with beat: the production shape on one machine.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import httpx

from nightshift.workers import procs

PG_ADMIN_URL = os.environ.get("NIGHTSHIFT_BENCH_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("NIGHTSHIFT_BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@contextlib.contextmanager
def postgres_database(admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """A new, empty Postgres database (dropped afterwards)."""
    import sqlalchemy as sa

    name = f"nightshift_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        from nightshift.storage.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextlib.contextmanager
def redis_database(url: str = REDIS_URL) -> Iterator[str]:
    """A Redis database, emptied before and after."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()


@contextlib.contextmanager
def moto_s3(log_dir: Path) -> Iterator[tuple[str, str]]:
    """moto's S3 server in its own process; yields (endpoint, bucket)."""
    import boto3

    port = free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_http(endpoint, proc, timeout=60)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket="nightshift-bench")
        yield endpoint, "nightshift-bench"
    finally:
        procs.stop(proc, timeout=10)


@dataclass
class RunningService:
    base_url: str
    api_key: str
    home: Path
    database_url: Optional[str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)


def _start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "wb")
    return subprocess.Popen(argv, env=env, cwd=procs.REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def running_service(shape: str, *, api_workers: int = 2, **settings: object) -> Iterator[RunningService]:
    """The whole service in ``shape`` ("embedded" or "services"), stopped and removed afterwards.
    ``settings`` become NIGHTSHIFT_* variables of every process."""
    work = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
    home = work / "home"
    home.mkdir()
    port = free_port()
    key = "ns-bench-" + uuid.uuid4().hex
    started: dict[str, subprocess.Popen] = {}
    try:
        with contextlib.ExitStack() as stack:
            if shape == "embedded":
                env = procs.service_env(home=home, bootstrap_key=key, **settings)
                started["serve"] = _start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                                    "--log-level", "warning"], env, work)
                database_url = None
            elif shape == "services":
                database_url = stack.enter_context(postgres_database())
                broker = stack.enter_context(redis_database())
                endpoint, bucket = stack.enter_context(moto_s3(work))
                env = procs.service_env(home=home, bootstrap_key=key, database_url=database_url, broker_url=broker,
                                        object_store="s3", s3_bucket=bucket, s3_endpoint_url=endpoint,
                                        s3_access_key_id="bench", s3_secret_access_key="bench",
                                        s3_addressing_style="path", **settings)
                subprocess.run([sys.executable, "-m", "nightshift.api.cli", "migrate"], env=env, cwd=procs.REPO, check=True,
                               capture_output=True)
                started["api"] = _start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                                                "--workers", str(api_workers), "--host", "127.0.0.1", "--port",
                                                str(port), "--log-level", "warning"], env, work)
                # nice 10, as `nightshift serve` runs it: on one machine the engine stands in for a
                # separate engine host and must not take the API's CPU.
                started["gpu"] = procs.start_worker(env, "gpu", "bench-gpu", work / "gpu.log", nice=10)
                started["cpu"] = procs.start_worker(env, "cpu,upkeep", "bench-cpu", work / "cpu.log", beat=True)
            else:
                raise ValueError(f"unknown shape {shape!r}")
            front = started.get("serve") or started["api"]
            wait_http(f"http://127.0.0.1:{port}/health", front)
            try:
                yield RunningService(f"http://127.0.0.1:{port}/v1", key, home, database_url, started)
            finally:
                for proc in started.values():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGTERM)
                for proc in started.values():
                    procs.stop(proc, timeout=15)
    finally:
        shutil.rmtree(work, ignore_errors=True)

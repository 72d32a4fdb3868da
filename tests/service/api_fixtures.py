"""Running the real service for API and end-to-end tests: the API as a uvicorn subprocess
(and, for end-to-end runs, real Celery workers), configured only through NIGHTSHIFT_* env,
exactly as in production. Test modules import the fixtures they use from here."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import httpx
import pytest

from bench.services import free_port
from nightshift.workers import procs
from tests.service import celery_procs

REPO = procs.REPO


def service_env(home: Path, **values) -> dict[str, str]:
    """A clean environment for service subprocesses with its own home (celery_procs.service_env: the tests' K/V pool)."""
    return celery_procs.service_env(home=home, **{k: v for k, v in values.items() if v is not None})


class Service:
    """Child processes started by a test; stopped (and waited for) at teardown."""

    def __init__(self, env: dict[str, str], log_dir: Path):
        self.env = env
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_api(self, port: int) -> str:
        self.start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
        base = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{base}/health", self.procs["api"])
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{self.log('api')}") from None
        return f"{base}/v1"

    def start_serve(self, port: int) -> str:
        """`nightshift serve` (API, workers and beat in one process tree, the embedded default); its
        /v1 base URL once it answers."""
        server = self.start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                      "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        return f"http://127.0.0.1:{port}/v1"

    def start_worker(self, queue: str, beat: bool = False) -> subprocess.Popen:
        name = f"worker-{queue}"
        self.procs[name] = procs.start_worker(self.env, queue, f"{queue}-{uuid.uuid4().hex[:6]}",
                                              self.log_dir / f"{name}.log", beat=beat)
        return self.procs[name]

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def logs(self) -> str:
        """The tail of every log this service wrote, for a failure message: each process it
        started and, under an embedded home (`nightshift serve`), each worker's log there."""
        paths = [self.log_dir / f"{name}.log" for name in self.procs]
        home = self.env.get("NIGHTSHIFT_HOME")
        if home:
            paths += sorted((Path(home) / "logs").glob("*.log"))
        return "\n".join(f"--- {path.name} ---\n{path.read_text(errors='replace')[-4000:]}"
                         for path in paths if path.exists())

    def stop(self) -> None:
        for proc in self.procs.values():
            procs.stop(proc)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def s3_env(endpoint: str, bucket: str) -> dict:
    return {"object_store": "s3", "s3_bucket": bucket, "s3_endpoint_url": endpoint, "s3_region": "us-east-1",
            "s3_access_key_id": "test", "s3_secret_access_key": "test", "s3_addressing_style": "path"}


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"nightshift-api-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=name)
    return name


def make_key(db_url: str, project: str) -> str:
    from nightshift.jobs.projects.api_keys import create_key
    from nightshift.storage.db import session_scope

    with session_scope(db_url) as session:
        return create_key(session, project)[1]


def openai_client(base_url: str, key: str, **kwargs):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def api_service(pg_url, s3_server, tmp_path_factory):
    """The API alone (no workers) on a fresh port, on the session's Postgres and moto S3, with
    small limits so the limit checks can be exercised. Messages go to a filesystem broker."""
    home = tmp_path_factory.mktemp("api-home")
    bucket = new_bucket(s3_server)
    env = service_env(home, database_url=pg_url, max_lines=50, max_file_bytes=64 * 1024,
                      **s3_env(s3_server, bucket))
    service = Service(env, home)
    try:
        service.base_url = service.start_api(free_port())
        service.db_url = pg_url
        service.s3_endpoint, service.bucket = s3_server, bucket
        yield service
    finally:
        service.stop()


def project_client(service, name: Optional[str] = None):  # noqa: ANN001, ANN201
    """An openai client holding a new key of a new project."""
    return openai_client(service.base_url, make_key(service.db_url, name or f"proj-{uuid.uuid4().hex[:8]}"))


@contextlib.contextmanager
def production_pipeline(pg_url: str, s3_server: str, tmp_path: Path, redis_db: int, project_prefix: str,
                        **settings: object):
    """The production shape for end-to-end tests: the HTTP API, a cpu worker with beat and a gpu
    worker on Redis database ``redis_db`` (emptied before and after), Postgres and a new moto
    bucket; yields (service, an openai client holding the bootstrap key). ``settings``: more
    NIGHTSHIFT_* values for every process."""
    import redis

    broker = celery_procs.redis_db_url(redis_db)
    redis.Redis.from_url(broker).flushdb()
    key = "ns-e2e-" + uuid.uuid4().hex
    env = service_env(tmp_path, database_url=pg_url, broker_url=broker, bootstrap_key=key,
                      bootstrap_project=f"{project_prefix}-{uuid.uuid4().hex[:8]}",
                      **{"reconcile_interval_seconds": 2, **settings}, **s3_env(s3_server, new_bucket(s3_server)))
    service = Service(env, tmp_path)
    try:
        base_url = service.start_api(free_port())
        service.start_worker("cpu,upkeep", beat=True)
        service.start_worker("gpu")
        yield service, openai_client(base_url, key, timeout=60)
    finally:
        service.stop()
        redis.Redis.from_url(broker).flushdb()

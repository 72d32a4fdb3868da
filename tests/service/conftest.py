"""Fixtures for service tests: a fresh Postgres database per test session (created, migrated
with `alembic upgrade head`, dropped), SQLite under tmp_path, moto's S3 server on
127.0.0.1, Redis on 127.0.0.1:6379, settings pointed at them."""
from __future__ import annotations

import logging
import os
import secrets
import uuid

import pytest
import sqlalchemy as sa

from .celery_procs import redis_db_url

PG_ADMIN_URL = os.environ.get("NIGHTSHIFT_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")

DEFAULT_REDIS_DB = 7   # the redis_url fixture's database in a file that names no REDIS_DB of its own
TABLES_CHILD_FIRST = ("requests", "shards", "batches", "files", "api_keys", "projects")


def _admin_engine():
    return sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


@pytest.fixture(scope="session")
def pg_url():
    """A new Postgres database for this test session, migrated to head; dropped at the end."""
    from nightshift.migrations import upgrade_head
    from nightshift.storage.db import dispose_engines

    name = f"nightshift_test_{os.getpid()}_{secrets.token_hex(4)}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade_head(url)
        yield url
    finally:
        dispose_engines()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def clear_tables(url: str) -> None:
    from nightshift.storage.db import get_engine

    engine = get_engine(url)
    with engine.begin() as conn:
        names = set(sa.inspect(conn).get_table_names())
        for table in TABLES_CHILD_FIRST:
            if table in names:
                conn.exec_driver_sql(f"DELETE FROM {table}")


@pytest.fixture
def pg_db(pg_url):
    """The session's Postgres database, emptied before the test."""
    clear_tables(pg_url)
    yield pg_url


@pytest.fixture
def sqlite_db(tmp_path):
    from nightshift.migrations import upgrade_head

    url = f"sqlite:///{tmp_path / 'nightshift.db'}"
    upgrade_head(url)
    yield url


@pytest.fixture(params=["postgres", "sqlite"])
def any_db(request):
    """Runs the test on both databases (same code paths)."""
    if request.param == "postgres":
        yield request.getfixturevalue("pg_db")
    else:
        yield request.getfixturevalue("sqlite_db")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 in server mode on 127.0.0.1 (a real HTTP S3 API); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class S3Process:
    """moto's S3 server as its own process, which a test can pause (SIGSTOP) and resume: a
    stalled object store, as a network partition or an overloaded endpoint looks to a client."""

    def __init__(self, log_dir):  # noqa: ANN001
        import subprocess
        import sys

        from bench.services import free_port, wait_http

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=open(log_dir / "moto.log", "wb"), stderr=subprocess.STDOUT)
        wait_http(self.endpoint, self.proc, timeout=60)

    def new_bucket(self) -> str:
        import boto3

        name = f"nightshift-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="test",
                     aws_secret_access_key="test").create_bucket(Bucket=name)
        return name

    def pause(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def s3_process(tmp_path):
    server = S3Process(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    import boto3

    name = f"nightshift-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket=name)
    yield name


def pytest_collection_modifyitems(config, items):
    """Each test file that uses Redis has a database of its own (`REDIS_DB` in the module, 7 for
    the `redis_url` fixture where the module names none): scripts/test.sh runs files on two
    workers at once, and two files on one database would take each other's Celery messages and
    empty each other's database. Two files with one number are refused here, before any test runs."""
    owners: dict[int, str] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        db = getattr(module, "REDIS_DB", DEFAULT_REDIS_DB if "redis_url" in item.fixturenames else None)
        if db is None:
            continue
        owner = owners.setdefault(db, module.__name__)
        if owner != module.__name__:
            raise pytest.UsageError(f"Redis database {db} is used by both {owner} and {module.__name__}: "
                                    "give one of them a REDIS_DB no other test file uses")


@pytest.fixture
def redis_url(request):
    """The test file's own Redis database (its REDIS_DB, else 7), emptied before and after."""
    import redis

    db = getattr(request.module, "REDIS_DB", DEFAULT_REDIS_DB)
    url = redis_db_url(db)
    client = redis.Redis.from_url(url)
    client.ping()
    client.flushdb()
    yield url
    client.flushdb()


@pytest.fixture
def settings_env(monkeypatch, tmp_path):
    """Point NIGHTSHIFT_* at tmp_path; returns a setter for more env vars. Clears cached settings."""
    from nightshift.settings import get_settings
    from nightshift.storage.objectstore import reset_object_store_cache

    for key in list(os.environ):
        if key.startswith("NIGHTSHIFT_") and key != "NIGHTSHIFT_MODEL_CACHE":
            monkeypatch.delenv(key)
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(f"NIGHTSHIFT_{k.upper()}", str(v))
        get_settings.cache_clear()
        reset_object_store_cache()
        return get_settings()

    set_env()
    yield set_env
    get_settings.cache_clear()
    reset_object_store_cache()

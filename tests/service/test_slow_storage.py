"""Slow storage and slow readers must not take the service down (production shape: uvicorn on
Postgres, moto's S3 server, real Celery workers): slow downloads hold no database connection; a
stalled S3 fails calls within bounded timeouts while the rest of the API answers; a finalize
stuck on S3 holds its lease (not re-sent) and does not stop the upkeep worker; uploads that die
midway leave nothing behind once swept."""
from __future__ import annotations

import statistics
import sys
import threading
import time

import boto3
import httpx
import pytest
from sqlalchemy import func, select

from nightshift.jobs.batches.models import Batch
from nightshift.jobs.files.models import File
from nightshift.storage.db import session_scope
from nightshift.storage.s3 import S3Store

from .api_fixtures import Service, free_port, make_key, new_bucket, s3_env, service_env, wait_http
from .celery_procs import service_env as worker_env
from .celery_procs import start_worker, stop, wait_for

pytestmark = pytest.mark.slow
REDIS_DB = 4   # the redis_url fixture's database here, apart from the other files' databases


def s3_client(endpoint: str):  # noqa: ANN201
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                        aws_secret_access_key="test")


def start_api(service: Service) -> str:
    port = free_port()
    service.start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                          "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
    wait_http(f"http://127.0.0.1:{port}/health", service.procs["api"])
    return f"http://127.0.0.1:{port}/v1"


def upload(base_url: str, key: str, size: int) -> str:
    line = b'{"custom_id": "x%09d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "default", ' \
           b'"messages": [{"role": "user", "content": "' + b"a" * 150 + b'"}]}}\n'
    data = b"".join(line % i for i in range(size // len(line)))
    response = httpx.post(f"{base_url}/files", headers={"Authorization": f"Bearer {key}"},
                          data={"purpose": "batch"}, files={"file": ("big.jsonl", data)}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def timed_gets(base_url: str, key: str, n: int) -> list[float]:
    seconds = []
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        for _ in range(n):
            started = time.monotonic()
            assert client.get(f"{base_url}/batches?limit=1").status_code == 200
            seconds.append(time.monotonic() - started)
            time.sleep(0.05)
    return seconds


def test_forty_slow_readers_hold_no_connection_and_other_requests_stay_fast(pg_db, s3_server, tmp_path):
    bucket = new_bucket(s3_server)
    # 40 requests of one key arrive at once: above the per-key cap on requests in progress
    # (api_key_inflight, tested in test_rate_limits.py), raised here so that all 40 get in
    service = Service(service_env(tmp_path, database_url=pg_db, db_pool_size=4, api_key_inflight=64,
                                  **s3_env(s3_server, bucket)), tmp_path)
    try:
        base_url = start_api(service)
        key = make_key(pg_db, "readers")
        file_id = upload(base_url, key, 3_000_000)
        stop_reading = threading.Event()
        started_reading = threading.Barrier(41)

        def slow_reader() -> None:
            with httpx.stream("GET", f"{base_url}/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"},
                              timeout=60) as response:
                assert response.status_code == 200
                started_reading.wait(30)
                for _ in response.iter_bytes(16 * 1024):
                    if stop_reading.wait(0.1):      # ~160 KB/s: the transfer outlives the test
                        break

        readers = [threading.Thread(target=slow_reader, daemon=True) for _ in range(40)]
        for r in readers:
            r.start()
        started_reading.wait(30)                    # 40 downloads open, more than the pool (4) holds
        seconds = timed_gets(base_url, key, 30)
        stop_reading.set()
        for r in readers:
            r.join(30)
    finally:
        service.stop()
    assert max(seconds) < 1.0 and statistics.median(seconds) < 0.2, seconds


def test_a_stalled_s3_fails_downloads_in_bounded_time_while_the_api_answers(pg_db, s3_process, tmp_path):
    bucket = s3_process.new_bucket()
    env = service_env(tmp_path, database_url=pg_db, s3_connect_timeout_seconds=1, s3_read_timeout_seconds=2,
                      s3_max_attempts=2, **s3_env(s3_process.endpoint, bucket))
    service = Service(env, tmp_path)
    try:
        base_url = start_api(service)
        key = make_key(pg_db, "stall")
        file_id = upload(base_url, key, 200_000)
        s3_process.pause()
        try:
            results = {}

            def download() -> None:
                started = time.monotonic()
                try:
                    status = httpx.get(f"{base_url}/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"},
                                       timeout=60).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                results["status"], results["seconds"] = status, time.monotonic() - started

            downloader = threading.Thread(target=download)
            downloader.start()
            seconds = timed_gets(base_url, key, 10)          # the database side answers meanwhile
            downloader.join(60)
        finally:
            s3_process.resume()
        assert max(seconds) < 1.0, seconds
        assert results["status"] == 500 and results["seconds"] < 20, results   # 2 attempts x (1 s + 2 s), not minutes
        again = httpx.get(f"{base_url}/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert again.status_code == 200 and len(again.content) > 0
    finally:
        service.stop()


def test_a_finalize_stuck_on_s3_keeps_its_lease_and_does_not_stop_upkeep(pg_db, redis_url, s3_process, settings_env,
                                                                         tmp_path):
    from nightshift.jobs.batches.leases import claim_shard, complete_shard, pending_requests, write_results
    from nightshift.jobs.batches.lifecycle import start_finalize_if_done
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.celery_app import TASK_FINALIZE, make_celery
    from tests.service.factories import in_transaction, make_running_batch
    from tests.service.test_batch_lifecycle import ok

    bucket = s3_process.new_bucket()
    conf = dict(database_url=pg_db, broker_url=redis_url, object_store="s3", s3_bucket=bucket,
                s3_endpoint_url=s3_process.endpoint, s3_access_key_id="t", s3_secret_access_key="t",
                s3_addressing_style="path", s3_connect_timeout_seconds=1, s3_read_timeout_seconds=4,
                s3_max_attempts=2, lease_seconds=4, heartbeat_seconds=1, reconcile_interval_seconds=1,
                requeue_pending_after_seconds=1)
    settings = settings_env(**conf)
    store = get_object_store()
    bid, shards = make_running_batch(pg_db, store, 4, 1)
    lease = in_transaction(pg_db, claim_shard, shards[0], "w", 30)
    in_transaction(pg_db, write_results, lease, [ok(r.id) for r in in_transaction(pg_db, pending_requests, lease)], 30)
    assert in_transaction(pg_db, complete_shard, lease)
    with session_scope(pg_db) as s:
        assert start_finalize_if_done(s, bid)
    env = worker_env(**conf)
    cpu = start_worker(env, "cpu", "cpu", tmp_path / "cpu.log")
    upkeep = start_worker(env, "upkeep", "upkeep", tmp_path / "upkeep.log", beat=True)
    try:
        wait_for(lambda: "ready" in (tmp_path / "cpu.log").read_text(errors="replace"), 60, 0.2, "cpu worker")
        s3_process.pause()
        make_celery(settings).send_task(TASK_FINALIZE, args=[bid], queue="cpu")
        time.sleep(6)                                     # finalize is stuck on S3, renewing its lease
        upkeep_log = (tmp_path / "upkeep.log").read_text(errors="replace")
        cpu_log = (tmp_path / "cpu.log").read_text(errors="replace")
        assert upkeep_log.count("nightshift.reconcile[") >= 3             # reconcile keeps running
        assert cpu_log.count(f"Task {TASK_FINALIZE}[") == 1                # received once: not re-sent
        s3_process.resume()
        wait_for(lambda: _status(pg_db, bid) == "completed", 120, 0.5, "batch completed after S3 resumed")
    finally:
        s3_process.resume()
        stop(cpu)
        stop(upkeep)
    with session_scope(pg_db) as s:
        assert s.get(Batch, bid).finalize_lease_expires_at is None


def _status(db_url: str, bid: str) -> str:
    with session_scope(db_url) as s:
        return s.get(Batch, bid).status


def test_an_upload_killed_midway_leaves_nothing_once_swept(pg_db, s3_process, tmp_path):
    bucket = s3_process.new_bucket()
    env = service_env(tmp_path, database_url=pg_db, max_file_bytes=100_000_000, max_lines=1_000_000,
                      s3_multipart_chunk_bytes=5 * 2 ** 20,
                      **s3_env(s3_process.endpoint, bucket))
    service = Service(env, tmp_path)
    client = s3_client(s3_process.endpoint)
    try:
        base_url = start_api(service)
        key = make_key(pg_db, "killed")
        sender = threading.Thread(target=lambda: _upload_quietly(base_url, key, 40_000_000), daemon=True)
        sender.start()
        wait_for(lambda: client.list_multipart_uploads(Bucket=bucket).get("Uploads"), 120, 0.05,
                 "the API's multipart upload to S3 to begin")
        service.procs["api"].kill()                        # SIGKILL between parts
        service.procs["api"].wait(10)
    finally:
        service.stop()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads")       # left behind by the dead process
    with session_scope(pg_db) as s:
        assert s.scalar(select(func.count()).select_from(File).where(File.filename == "big.jsonl")) == 0
    store = S3Store(client, bucket)
    # (moto reports every upload as initiated in 2010, so the age rule is checked on the local store)
    assert store.sweep_abandoned(older_than_seconds=0) >= 1
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not client.list_objects_v2(Bucket=bucket).get("Contents")          # the file exists whole or not at all


def _upload_quietly(base_url: str, key: str, size: int) -> None:
    try:
        upload(base_url, key, size)
    except (AssertionError, httpx.HTTPError):
        pass                                                                   # the API died under it


def test_a_failed_multipart_upload_is_aborted_by_the_writer(s3_process):
    bucket = s3_process.new_bucket()
    client = s3_client(s3_process.endpoint)
    store = S3Store(client, bucket, chunk_bytes=5 * 2 ** 20)

    def chunks():  # noqa: ANN202
        for _ in range(3):
            yield b"x" * 4 * 2 ** 20
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        store.put_stream("files/broken", chunks())
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not store.exists("files/broken")


def test_the_local_store_sweeps_only_old_temporary_files(tmp_path):
    import os

    from nightshift.storage.localdir import LocalDirStore

    store = LocalDirStore(tmp_path / "objects")
    store.put_stream("files/kept", b"whole")
    old = tmp_path / "objects" / "files" / ".tmp-dead"
    young = tmp_path / "objects" / "files" / ".tmp-writing"
    old.write_bytes(b"half")
    young.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert store.sweep_abandoned(older_than_seconds=3600) == 1
    assert not old.exists() and young.exists() and store.exists("files/kept")

"""End to end, production shape, with a controllable clock: two "beats" send the schedules
tick for the same instant to two real Celery cpu workers on real Redis; a gpu worker runs
the real default model; Postgres and moto's S3 hold the state. Checks: one run per due
time, the scheduled batch completes, outputs + manifest under the index prefix, cost files,
and the next night re-processes only the changed document."""
from __future__ import annotations

import sys
import threading
import time
import uuid
from datetime import datetime, timezone

import orjson
import pytest
import redis
from celery import Celery
from sqlalchemy import func, select

from nightshift.jobs.batches.models import Batch, Request
from nightshift.jobs.costs.batch_costs import cost_file_ids
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import Project
from nightshift.jobs.schedules.models import RunStatus, ScheduleRun
from nightshift.jobs.schedules.service import create_schedule
from nightshift.storage.db import session_scope
from nightshift.storage.s3 import S3Store
from nightshift.workers.celery_app import TASK_SCHEDULES_TICK

from .api_fixtures import Service, new_bucket, s3_env, service_env
from .celery_procs import redis_db_url

REDIS_DB = 13


def ts(day: int) -> float:
    return datetime(2030, 1, day, 2, 0, 5, tzinfo=timezone.utc).timestamp()   # 5 s after 02:00 UTC


@pytest.fixture
def cluster(pg_db, s3_server, tmp_path):
    import boto3

    broker = redis_db_url(REDIS_DB)
    redis.Redis.from_url(broker).flushdb()
    bucket = new_bucket(s3_server)
    env = service_env(tmp_path, database_url=pg_db, broker_url=broker, **s3_env(s3_server, bucket))
    service = Service(env, tmp_path)
    store = S3Store(boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                                 aws_access_key_id="test", aws_secret_access_key="test"), bucket)
    try:
        for name in ("cpu-a", "cpu-b"):   # two cpu workers: the two ticks really run at once
            service.start(f"worker-{name}", [sys.executable, "-m", "celery", "-A", "nightshift.workers.celery_app", "worker",
                                             "-Q", "cpu", "-c", "1", "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
                                             "--loglevel", "INFO"])
        service.start_worker("gpu")
        producers = [Celery(broker=broker) for _ in range(2)]   # stand-ins for two beat processes
        yield service, store, producers, pg_db
    finally:
        service.stop()
        redis.Redis.from_url(broker).flushdb()


def wait_for_run(db_url: str, schedule_id: str, due_at: float, service: Service, timeout: float = 420) -> ScheduleRun:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with session_scope(db_url) as s:
            run = s.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule_id,
                                                      ScheduleRun.due_at == due_at)).first()
            if run is not None and run.status in (RunStatus.SUCCEEDED, RunStatus.FAILED):
                return run
        for name in ("worker-gpu", "worker-cpu-a", "worker-cpu-b"):
            if "raised unexpected" in service.log(name):   # a task crashed: say so now, not at the timeout
                raise AssertionError(f"{name} failed a task:\n{service.log(name)}")
        time.sleep(0.5)
    raise AssertionError(f"run for {due_at} not finished:\n{service.logs()}")


def tick_from_both(producers: list[Celery], now: float) -> None:
    barrier = threading.Barrier(len(producers))

    def send(app: Celery) -> None:
        barrier.wait()
        app.send_task(TASK_SCHEDULES_TICK, kwargs={"now": now}, queue="cpu")

    threads = [threading.Thread(target=send, args=(app,)) for app in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def read_json(store: S3Store, key: str) -> dict:
    return orjson.loads(b"".join(store.get_stream(key)))


@pytest.mark.slow
def test_nightly_reindex_end_to_end(cluster):
    service, store, producers, db_url = cluster
    store.put_stream("docs/a.txt", b"The cat sat on the mat.")
    store.put_stream("docs/b.txt", b"Paris is the capital of France.")
    with session_scope(db_url) as s:
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
        s.flush()
        schedule_id = create_schedule(
            s, project_id=pid, name="nightly", cron="0 2 * * *", endpoint="/v1/chat/completions",
            model="default", source={"type": "prefix", "prefix": "docs/"}, index_prefix="index/",
            prompt_template={"messages": [{"role": "user", "content": "Summarize: {{ document }}"}],
                             "max_tokens": 4, "temperature": 0},
            now=ts(1) - 86400).id

    # night 1: both beats tick at once, and one ticks again later (a restart): one run
    tick_from_both(producers, ts(1))
    run1 = wait_for_run(db_url, schedule_id, ts(1) - 5, service)
    producers[0].send_task(TASK_SCHEDULES_TICK, kwargs={"now": ts(1) + 60}, queue="cpu")
    assert run1.status == RunStatus.SUCCEEDED, run1.error
    assert (run1.documents_selected, run1.documents_indexed) == (2, 2)
    with session_scope(db_url) as s:
        batch = s.get(Batch, run1.batch_id)
        assert batch.status == "completed" and batch.metadata_["schedule_run_id"] == run1.id
        json_id, csv_id = cost_file_ids(batch.id)
        assert s.get(File, json_id) is not None and s.get(File, csv_id) is not None
        completion = s.scalar(select(func.sum(Request.completion_tokens)).where(Request.batch_id == batch.id))
        cost = read_json(store, s.get(File, json_id).object_key)
    assert cost["requests"]["completed"] == 2 and cost["tokens"]["completion_tokens"] == completion > 0
    assert cost["engine_seconds"] > 0 and cost["by_device"][0]["device"] == "cpu"
    out = read_json(store, "index/a.txt.json")
    assert out["run_id"] == run1.id and out["response"]["choices"][0]["message"]["content"]
    manifest = read_json(store, "index/_manifest.json")
    assert sorted(manifest["documents"]) == ["a.txt", "b.txt"]

    # night 2: only b changed
    store.put_stream("docs/b.txt", b"Rome is the capital of Italy.")
    tick_from_both(producers, ts(2))
    run2 = wait_for_run(db_url, schedule_id, ts(2) - 5, service)
    assert run2.status == RunStatus.SUCCEEDED, run2.error
    assert (run2.documents_total, run2.documents_selected, run2.documents_indexed) == (2, 1, 1)
    manifest = read_json(store, "index/_manifest.json")
    assert manifest["documents"]["a.txt"]["run_id"] == run1.id
    assert manifest["documents"]["b.txt"]["run_id"] == run2.id
    time.sleep(2)   # let the late restart tick land: still one run per due time
    with session_scope(db_url) as s:
        due_times = s.scalars(select(ScheduleRun.due_at).where(ScheduleRun.schedule_id == schedule_id)).all()
    assert sorted(due_times) == [ts(1) - 5, ts(2) - 5]


@pytest.mark.slow
def test_four_nights_of_embedding_reindex(cluster):
    """An embeddings schedule over four nights: adds, an edit, a delete and a quiet night. Only
    changed documents are embedded again; each run writes one index file holding every current
    document's vector (unchanged ones carried over, deleted ones gone), and the manifest names it."""
    import math

    service, store, producers, db_url = cluster
    docs = {"a.txt": b"The cat sat on the mat.", "b.txt": b"Paris is the capital of France.",
            "c.txt": b"Photosynthesis turns light into chemical energy."}
    for key, data in docs.items():
        store.put_stream(f"docs/{key}", data)
    with session_scope(db_url) as s:
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
        s.flush()
        schedule_id = create_schedule(
            s, project_id=pid, name="vectors", cron="0 2 * * *", endpoint="/v1/embeddings", model="default",
            source={"type": "prefix", "prefix": "docs/"}, index_prefix="vectors/",
            prompt_template={"input": "{{ document }}"}, now=ts(1) - 86400).id

    def night(day: int) -> tuple[ScheduleRun, dict, dict[str, dict]]:
        tick_from_both(producers, ts(day))
        run = wait_for_run(db_url, schedule_id, ts(day) - 5, service)
        assert run.status == RunStatus.SUCCEEDED, run.error
        manifest = read_json(store, "vectors/_manifest.json")
        assert manifest["index_file"] == f"vectors/_index/{run.id}.jsonl"
        index = {e["key"]: e for e in map(orjson.loads, b"".join(store.get_stream(manifest["index_file"])).splitlines())}
        assert sorted(index) == sorted(manifest["documents"])
        for key, entry in index.items():
            assert entry["sha256"] == manifest["documents"][key]["sha256"]
            assert len(entry["vector"]) == 384 and abs(math.sqrt(sum(x * x for x in entry["vector"])) - 1) < 1e-4
        return run, manifest, index

    run1, _, index1 = night(1)
    assert (run1.documents_selected, run1.documents_indexed) == (3, 3) and sorted(index1) == ["a.txt", "b.txt", "c.txt"]
    out = read_json(store, "vectors/b.txt.json")
    assert out["response"]["object"] == "list" and out["response"]["data"][0]["embedding"] == index1["b.txt"]["vector"]

    store.put_stream("docs/b.txt", b"Rome is the capital of Italy.")            # night 2: an edit and an add
    store.put_stream("docs/d.txt", b"Water boils at one hundred degrees Celsius at sea level.")
    run2, manifest2, index2 = night(2)
    assert (run2.documents_total, run2.documents_selected, run2.documents_indexed) == (4, 2, 2)
    assert index2["a.txt"] == index1["a.txt"] and index2["c.txt"] == index1["c.txt"]     # carried over
    assert index2["b.txt"]["vector"] != index1["b.txt"]["vector"] and "d.txt" in index2
    assert manifest2["documents"]["a.txt"]["run_id"] == run1.id and manifest2["documents"]["b.txt"]["run_id"] == run2.id

    store.delete("docs/a.txt")                                                     # night 3: a delete
    run3, manifest3, index3 = night(3)
    assert (run3.documents_selected, run3.documents_removed) == (0, 1) and run3.batch_id is None
    assert sorted(index3) == ["b.txt", "c.txt", "d.txt"] and not store.exists("vectors/a.txt.json")
    assert all(index3[k] == index2[k] for k in index3)

    run4, manifest4, index4 = night(4)                                             # night 4: nothing changed
    assert (run4.documents_total, run4.documents_selected, run4.documents_removed) == (3, 0, 0)
    assert index4 == index3 and manifest4["document_count"] == 3
    assert store.exists(manifest2["index_file"])                                   # earlier runs' files stay

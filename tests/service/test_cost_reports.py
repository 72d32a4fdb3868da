"""Cost reports against real Postgres (+ SQLite) and moto S3: exact sums of request rows,
idempotent files at finalize, per-day aggregation per project."""
from __future__ import annotations

import csv
import io
import math
from datetime import datetime, timezone

import pytest
from sqlalchemy import select

from nightshift.jobs.batches.models import Batch, Request
from nightshift.jobs.costs.batch_costs import (cost_file_ids, live_cost_report, read_cost_report,
                                               stored_cost_report_key, write_cost_files)
from nightshift.jobs.costs.daily_costs import costs_by_day
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import Project
from nightshift.storage.db import get_sessionmaker
from nightshift.storage.localdir import LocalDirStore
from nightshift.storage.s3 import S3Store

DAY1 = datetime(2026, 11, 21, 23, 50, tzinfo=timezone.utc).timestamp()


def seed_batch(sm, project_id: str, *, n: int, start: float, status="completed",
               devices=("cpu", "cuda:0")) -> str:
    with sm() as s, s.begin():
        file_id, batch_id = new_id("file-"), new_id("batch_")
        s.add(File(id=file_id, project_id=project_id, filename="in.jsonl", purpose="batch",
                   bytes=1, object_key=f"files/{file_id}"))
        s.flush()
        s.add(Batch(id=batch_id, project_id=project_id, input_file_id=file_id,
                    endpoint="/v1/chat/completions", status=status, model="default", request_total=n))
        s.flush()
        for i in range(n):
            never_run = i % 7 == 6   # drained at cancel/expiry: planned prompt_tokens, no answer
            s.add(Request(batch_id=batch_id, line=i + 1, custom_id=f"req-{i}", body={}, prompt_token_ids=[],
                          status="failed" if never_run else "completed",
                          response_status_code=None if never_run else 200,
                          error_code="batch_expired" if never_run else None,
                          prompt_tokens=50 + i, cached_tokens=0 if never_run else 16 * (i % 3),
                          completion_tokens=0 if never_run else 3 * i + 1,
                          engine_seconds=0.0 if never_run else 0.037 * (i + 1),
                          worker="w@host", device=None if never_run else devices[i % len(devices)],
                          queued_at=start, started_at=start + 1 + i, finished_at=start + 2 + i * 60))
    return batch_id


def make_project(sm) -> str:
    with sm() as s, s.begin():
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
    return pid


def rows_of(sm, batch_id):
    with sm() as s:
        return s.scalars(select(Request).where(Request.batch_id == batch_id,
                                               Request.response_status_code.is_not(None))).all()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalDirStore(tmp_path / "objects")
    import boto3
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    return S3Store(client, bucket, prefix="nightshift")


def test_cost_files_are_exact_sums_and_idempotent(any_db, store, settings_env):
    settings = settings_env(instance_usd_per_hour='{"cpu": 0.2, "cuda": 3.0}')
    sm = get_sessionmaker(any_db)
    pid = make_project(sm)
    batch_id = seed_batch(sm, pid, n=30, start=DAY1)
    with sm() as s, s.begin():
        batch = s.get(Batch, batch_id)
        first = write_cost_files(s, store, batch, settings=settings, now=DAY1 + 7200)
    with sm() as s, s.begin():   # finalize runs again (redelivered message): same files, same sums
        second = write_cost_files(s, store, s.get(Batch, batch_id), settings=settings, now=DAY1 + 7300)
    rows = rows_of(sm, batch_id)
    json_id, csv_id = cost_file_ids(batch_id)
    assert first["files"] == second["files"] == {"json": json_id, "csv": csv_id}
    for key in ("tokens", "cost", "engine_seconds", "requests", "by_device", "savings"):
        assert first[key] == second[key]
    with sm() as s:
        files = s.scalars(select(File).where(File.id.in_([json_id, csv_id]))).all()
        assert len(files) == 2 and all(f.project_id == pid for f in files)
        stored = read_cost_report(store, stored_cost_report_key(s, s.get(Batch, batch_id)))
        csv_file = s.get(File, csv_id)
    assert stored["files"] == first["files"]
    assert stored["tokens"]["prompt_tokens"] == sum(r.prompt_tokens for r in rows)
    assert stored["tokens"]["cached_prompt_tokens"] == sum(r.cached_tokens for r in rows)
    assert stored["tokens"]["completion_tokens"] == sum(r.completion_tokens for r in rows)
    assert stored["requests"] == {"total": 30, "completed": 26, "failed": 4}
    assert stored["engine_seconds"] == math.fsum(r.engine_seconds for r in rows)
    expected = math.fsum(r.engine_seconds * (3.0 if r.device == "cuda:0" else 0.2) / 3600
                         for r in rows if r.device)
    assert stored["cost"]["usd"] == expected
    parsed = list(csv.DictReader(io.StringIO(b"".join(store.get_stream(csv_file.object_key)).decode())))
    assert len(parsed) == 30 and csv_file.bytes > 0
    assert math.fsum(float(r["cost_usd"]) for r in parsed) == stored["cost"]["usd"]
    assert sum(int(r["prompt_tokens"]) for r in parsed) == stored["tokens"]["prompt_tokens"]
    assert {r["worker"] for r in parsed} == {"w@host"}


def test_live_report_while_running(pg_db, settings_env):
    settings = settings_env()
    sm = get_sessionmaker(pg_db)
    batch_id = seed_batch(sm, make_project(sm), n=5, start=DAY1, status="in_progress")
    with sm() as s:
        report = live_cost_report(s, s.get(Batch, batch_id), settings)
    assert report["status"] == "in_progress"
    assert report["files"] == {"json": None, "csv": None}
    assert report["tokens"]["prompt_tokens"] == sum(r.prompt_tokens for r in rows_of(sm, batch_id))


def test_costs_per_day_per_project(any_db, settings_env):
    settings = settings_env(instance_usd_per_hour='{"cpu": 0.2, "cuda": 3.0}')
    sm = get_sessionmaker(any_db)
    pid, other = make_project(sm), make_project(sm)
    b1 = seed_batch(sm, pid, n=20, start=DAY1)          # finishes across midnight UTC
    b2 = seed_batch(sm, pid, n=4, start=DAY1 + 86400 + 1200)  # 2026-11-23 00:10
    seed_batch(sm, other, n=9, start=DAY1)               # another project's spend is not counted
    with sm() as s:
        report = costs_by_day(s, pid, start=DAY1 - 86400, end=DAY1 + 3 * 86400, settings=settings)
    rows = rows_of(sm, b1) + rows_of(sm, b2)
    assert [d["date"] for d in report["data"]] == ["2026-11-21", "2026-11-22", "2026-11-23"]
    assert report["total"]["requests"] == len(rows) == 24 - 2
    assert report["total"]["prompt_tokens"] == sum(r.prompt_tokens for r in rows)
    assert report["total"]["completion_tokens"] == sum(r.completion_tokens for r in rows)
    day1 = [r for r in rows if r.finished_at < datetime(2026, 11, 22, tzinfo=timezone.utc).timestamp()]
    assert report["data"][0]["requests"] == len(day1)
    assert [d["batches"] for d in report["data"]] == [1, 1, 1]
    assert report["data"][2]["requests"] == 4
    assert report["total"]["cost_usd"] == pytest.approx(math.fsum(
        r.engine_seconds * (3.0 if r.device == "cuda:0" else 0.2) / 3600 for r in rows if r.device), rel=1e-12)
    with sm() as s:
        narrow = costs_by_day(s, pid, start=DAY1 + 86400, end=DAY1 + 2 * 86400, settings=settings)
        assert costs_by_day(s, new_id("proj_"), start=0, end=1e12, settings=settings)["data"] == []
    assert 0 < sum(d["requests"] for d in narrow["data"]) < len(rows)

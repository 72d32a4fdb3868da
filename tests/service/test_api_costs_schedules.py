"""/v1/schedules and the cost routes over HTTP against the running API (uvicorn subprocess on
the session's Postgres and moto S3): shapes, errors naming the parameter, tenancy (404)."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import httpx
import orjson
import pytest

from nightshift.jobs.batches.models import Batch, Request
from nightshift.jobs.projects.api_keys import project_for_key
from nightshift.jobs.schedules.firing import fire_schedule
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.s3 import S3Store
from nightshift.workers.finalize import finalize_batch
from tests.service.factories import in_transaction, make_running_batch

from .api_fixtures import api_service, make_key  # noqa: F401

TEMPLATE = {"messages": [{"role": "user", "content": "Summarize:\n{{ document }}"}], "max_tokens": 16}


def http(service, key: str | None = None) -> httpx.Client:  # noqa: ANN001
    key = key or make_key(service.db_url, f"proj-{uuid.uuid4().hex[:8]}")
    return httpx.Client(base_url=service.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def schedule_body(**overrides) -> dict:
    body = {"name": "nightly", "cron": "0 2 * * *", "timezone": "Europe/Berlin",
            "endpoint": "/v1/chat/completions", "model": "default",
            "source": {"type": "prefix", "prefix": "docs/"}, "prompt_template": TEMPLATE,
            "metadata": {"team": "search"}}
    return body | overrides


def test_schedule_crud_pause_resume_runs_and_tenancy(api_service):  # noqa: F811
    client, stranger = http(api_service), http(api_service)
    created = client.post("/schedules", json=schedule_body())
    assert created.status_code == 200, created.text
    sched = created.json()
    assert sched["id"].startswith("sched_") and sched["object"] == "schedule"
    assert (sched["status"], sched["timezone"], sched["index_prefix"]) == \
        ("active", "Europe/Berlin", f"index/{sched['id']}/")
    next_run = datetime.fromtimestamp(sched["next_run_at"], timezone.utc)
    assert next_run.minute == 0 and next_run.hour in (0, 1)           # 02:00 Berlin in UTC
    assert client.post("/schedules", json=schedule_body()).status_code == 409
    assert client.get(f"/schedules/{sched['id']}").json()["name"] == "nightly"
    page = client.get("/schedules").json()
    assert page["object"] == "list" and [s["id"] for s in page["data"]] == [sched["id"]]
    # another project's key sees nothing
    assert stranger.get(f"/schedules/{sched['id']}").status_code == 404
    assert stranger.post(f"/schedules/{sched['id']}/pause").status_code == 404
    assert stranger.get("/schedules").json()["data"] == []

    updated = client.post(f"/schedules/{sched['id']}", json={"cron": "30 3 * * *", "timezone": "UTC"}).json()
    assert datetime.fromtimestamp(updated["next_run_at"], timezone.utc).strftime("%H:%M") == "03:30"
    paused = client.post(f"/schedules/{sched['id']}/pause").json()
    assert (paused["status"], paused["next_run_at"]) == ("paused", None)
    resumed = client.post(f"/schedules/{sched['id']}/resume").json()
    assert resumed["status"] == "active" and resumed["next_run_at"] > time.time()

    # the beat fires it (clock moved to its due time): the run is listed
    fired = in_transaction(api_service.db_url, fire_schedule, sched["id"], resumed["next_run_at"] + 1)
    runs = client.get(f"/schedules/{sched['id']}/runs").json()["data"]
    assert [r["id"] for r in runs] == [fired] and runs[0]["status"] == "pending"
    assert runs[0]["due_at"] == resumed["next_run_at"] and runs[0]["object"] == "schedule.run"

    deleted = client.delete(f"/schedules/{sched['id']}").json()
    assert deleted == {"id": sched["id"], "object": "schedule", "deleted": True}
    assert client.get(f"/schedules/{sched['id']}").status_code == 404


@pytest.mark.parametrize("overrides, param", [
    ({"cron": "0 2 * *"}, "cron"),
    ({"timezone": "Mars/Base"}, "timezone"),
    ({"endpoint": "/v1/responses"}, "endpoint"),
    ({"model": "gpt-9"}, "model"),
    ({"prompt_template": None}, "prompt_template"),
    ({"prompt_template": {"prompt": "{{ document"}}, "prompt_template"),
    ({"source": {"type": "file", "file_id": "file-missing"}, "prompt_template": None}, "source.file_id"),
    ({"metadata": {f"k{i}": "v" for i in range(15)}}, "metadata"),
])
def test_schedule_refusals_name_the_parameter(api_service, overrides, param):  # noqa: F811
    answer = http(api_service).post("/schedules", json=schedule_body(**overrides))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def _s3_store(service) -> S3Store:  # noqa: ANN001
    import boto3

    env = service.env
    client = boto3.client("s3", endpoint_url=env["NIGHTSHIFT_S3_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    return S3Store(client, env["NIGHTSHIFT_S3_BUCKET"])


def _finish_all(db_url: str, batch_id: str, base: float) -> None:
    with session_scope(db_url) as s:
        for i, row in enumerate(s.query(Request).filter(Request.batch_id == batch_id).order_by(Request.line)):
            row.status, row.response_status_code = "completed", 200
            row.response_body = {"choices": [{"message": {"content": "ok"}}]}
            row.prompt_tokens, row.cached_tokens, row.completion_tokens = 100, 32, 10 + i
            row.engine_seconds, row.device, row.worker = 0.5, "cpu", "gpu-1@host"
            row.started_at, row.finished_at = base + i, base + i + 1
        for shard in s.get(Batch, batch_id).shards:
            shard.status = "done"
        s.get(Batch, batch_id).status = "finalizing"


def test_batch_cost_live_then_stored_html_and_per_day(api_service, tmp_path):  # noqa: F811
    key = make_key(api_service.db_url, f"proj-{uuid.uuid4().hex[:8]}")
    client, stranger = http(api_service, key), http(api_service)
    store = _s3_store(api_service)
    batch_id, _ = make_running_batch(api_service.db_url, store, 4, 2)
    with session_scope(api_service.db_url) as s:   # hand the batch to the key's project
        s.get(Batch, batch_id).project_id = project_for_key(s, key)

    live = client.get(f"/batches/{batch_id}/cost").json()
    assert live["status"] == "in_progress" and live["files"] == {"json": None, "csv": None}
    assert live["requests"]["total"] == 4 and live["tokens"]["prompt_tokens"] == 0

    base = datetime(2026, 11, 21, 23, 59, 58, tzinfo=timezone.utc).timestamp()   # across midnight
    _finish_all(api_service.db_url, batch_id, base)
    settings = Settings(database_url=api_service.db_url)   # the finalize task, run here on the API's database
    assert finalize_batch(batch_id, settings=settings, store=store).status == "completed"
    report = client.get(f"/batches/{batch_id}/cost").json()
    assert report["status"] == "completed" and report["files"]["json"].startswith("file-")
    assert report["tokens"] == {"prompt_tokens": 400, "cached_prompt_tokens": 128, "uncached_prompt_tokens": 272,
                                "completion_tokens": 46, "total_tokens": 446, "prefix_cache_hit_rate": 0.32}
    assert report["engine_seconds"] == 2.0 and report["cost"]["usd"] == pytest.approx(2.0 * 0.10 / 3600)
    # the report is also a downloadable file of the project
    content = client.get(f"/files/{report['files']['json']}/content")
    assert orjson.loads(content.content)["cost"] == report["cost"]
    csv_lines = client.get(f"/files/{report['files']['csv']}/content").text.strip().splitlines()
    assert len(csv_lines) == 5 and csv_lines[0].startswith("line,custom_id,status")
    page = client.get(f"/batches/{batch_id}/cost", params={"format": "html"})
    assert page.headers["content-type"].startswith("text/html") and "<svg" in page.text and batch_id in page.text
    assert stranger.get(f"/batches/{batch_id}/cost").status_code == 404

    daily = client.get("/costs", params={"from": "2026-11-21", "to": "2026-11-23"}).json()
    assert [(d["date"], d["requests"]) for d in daily["data"]] == [("2026-11-21", 1), ("2026-11-22", 3)]
    assert daily["total"]["completion_tokens"] == 46
    assert daily["total"]["cost_usd"] == pytest.approx(report["cost"]["usd"])
    assert stranger.get("/costs", params={"from": "2026-11-21", "to": "2026-11-23"}).json()["data"] == []
    bad = client.get("/costs", params={"from": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "from"

    # the CLI prints the same report
    import subprocess
    import sys

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nightshift.api.cli", "cost", batch_id, "--base-url", api_service.base_url,
                               "--api-key", key, *extra], capture_output=True, text=True, timeout=60,
                              env={**api_service.env, "COLUMNS": "120"})

    table = cli()
    assert table.returncode == 0, table.stderr
    assert f"cost of {batch_id} (completed)" in table.stdout and "cpu" in table.stdout
    shown = table.stdout.replace(batch_id, "")     # the id is random hex: it may hold "446" itself
    assert "446" not in shown and "400" in shown and "(32.0%)" in shown
    assert orjson.loads(cli("--json").stdout)["cost"] == report["cost"]
    assert cli("--csv").stdout.strip().splitlines() == csv_lines
    html_path = tmp_path / "cost.html"
    assert cli("--json", "--html", str(html_path)).returncode == 0
    assert "<svg" in html_path.read_text()
    missing = subprocess.run(
        [sys.executable, "-m", "nightshift.api.cli", "cost", "batch_nope", "--base-url", api_service.base_url, "--api-key", key],
        capture_output=True, text=True, timeout=60, env=api_service.env)
    assert missing.returncode != 0 and "404" in missing.stderr

"""GET /metrics scraped from the real service while a batch runs: API request counters and
latencies by route, the workers' counters (tokens, requests, engine steps, tasks, shard claims)
through the shared multiprocess directory, and the state gauges from the database and broker;
with two uvicorn workers the request counts of both add up."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .api_fixtures import Service, free_port, make_key, service_env, wait_http
from .test_cli_embedded import small_input


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@pytest.mark.slow
def test_metrics_move_while_a_batch_runs(tmp_path):
    input_path, expected = small_input(tmp_path / "input.jsonl", n=3)
    home = tmp_path / "home"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    service = Service(service_env(home, port=port), tmp_path)
    try:
        server = service.start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                         "--log-level", "warning"])
        wait_http(f"{base}/health", server, timeout=120)
        before = scrape(base)
        http = httpx.Client(base_url=f"{base}/v1", timeout=30,
                            headers={"Authorization": f"Bearer {(home / 'api_key').read_text().strip()}"})
        file_id = http.post("/files", data={"purpose": "batch"},
                            files={"file": ("in.jsonl", input_path.read_bytes())}).json()["id"]
        batch_id = http.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()["id"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and http.get(f"/batches/{batch_id}").json()["status"] != "completed":
            time.sleep(0.5)
        after = scrape(base)
    finally:
        service.stop()
    polls = total(after, "nightshift_http_requests_total", route="/v1/batches/{batch_id}", method="GET", status="200")
    assert polls >= 1 and total(before, "nightshift_http_requests_total", route="/v1/batches/{batch_id}") == 0
    assert total(after, "nightshift_http_request_duration_seconds_count", route="/v1/files", method="POST") == 1
    assert total(after, "nightshift_requests_processed_total", outcome="completed") == len(expected)
    assert total(after, "nightshift_tokens_total", kind="completion") > 0
    assert total(after, "nightshift_tokens_total", kind="prompt") > total(before, "nightshift_tokens_total", kind="prompt")
    assert total(after, "nightshift_engine_step_seconds_count") > 0
    assert total(after, "nightshift_shard_claims_total", kind="own") >= 1
    assert total(after, "nightshift_tasks_total", task="nightshift.run_shard", outcome="SUCCESS") >= 1
    assert total(after, "nightshift_tasks_total", task="nightshift.finalize", outcome="SUCCESS") >= 1
    assert total(after, "nightshift_batches", status="completed") == 1
    assert total(after, "nightshift_requests_pending") == 0
    assert ("nightshift_queue_messages", (("queue", "gpu"),)) in after


def test_two_uvicorn_workers_add_up_in_one_scrape(pg_db, tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = service_env(tmp_path, database_url=pg_db)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    service = Service(env, tmp_path)
    port = free_port()
    try:
        service.start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                              "--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{port}/health", service.procs["api"])
        key = make_key(pg_db, "metrics")
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}) as client:    # new connections: both workers
            for _ in range(40):
                assert client.get(f"http://127.0.0.1:{port}/v1/batches", headers={"connection": "close"}).status_code == 200
        samples = scrape(f"http://127.0.0.1:{port}")
    finally:
        service.stop()
    assert total(samples, "nightshift_http_requests_total", route="/v1/batches", status="200") == 40
    assert len(list(metrics_dir.glob("*.db"))) >= 2                     # both processes wrote samples


def test_metrics_command_serves_the_workers_samples(tmp_path):
    """`nightshift metrics` on a host with workers only: what a worker process wrote to the
    shared directory is scraped, summed over processes."""
    metrics_dir = tmp_path / "metrics"
    env = service_env(tmp_path)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    write = ("from nightshift.settings import get_settings; from nightshift.workers.metrics import use_metrics_dir;"
             "use_metrics_dir(get_settings()); from nightshift.workers.metrics import worker_metrics;"
             "m = worker_metrics(); m.requests.labels('completed').inc(3); m.tokens.labels('completion').inc(40)")
    for _ in range(2):                                   # two worker processes
        subprocess.run([sys.executable, "-c", write], env=env, check=True, timeout=60)
    service = Service(env, tmp_path)
    port = free_port()
    try:
        proc = service.start("metrics", [sys.executable, "-m", "nightshift.api.cli", "metrics", "--host", "127.0.0.1",
                                         "--port", str(port)])
        wait_http(f"http://127.0.0.1:{port}/metrics", proc)
        samples = scrape(f"http://127.0.0.1:{port}")
    finally:
        service.stop()
    assert total(samples, "nightshift_requests_processed_total", outcome="completed") == 6
    assert total(samples, "nightshift_tokens_total", kind="completion") == 80

"""An engine worker that cannot load its model, on the production shape (the HTTP API, real Celery
workers on Redis, Postgres, moto's S3), with short back-offs: the batch says why it waits, the
worker says so once and in /metrics, and the batch ends by itself with every custom_id as a
model_unavailable error line exactly once; a model that appears while the batch waits is loaded
at the next try and the batch completes (tests/service/test_engine_hosts.py has the parts)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sqlalchemy import select

from nightshift.engine.embeddings.model_files import resolve_embedding_model
from nightshift.jobs.engine_hosts.models import EngineHost
from nightshift.storage.db import session_scope

from .api_fixtures import production_pipeline

pytestmark = pytest.mark.slow

REDIS_DB = 9
FAST = dict(model_load_retry_seconds=1, model_load_retry_max_seconds=2, reconcile_interval_seconds=1,
            requeue_missing_after_seconds=1, engine_host_heartbeat_seconds=1, shard_max_requests=4)


def embedding_lines(n: int, model: str = "default") -> bytes:
    return b"".join(json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": model, "input": f"text number {i}"}}).encode() + b"\n"
                    for i in range(n))


def submit(client, data: bytes):  # noqa: ANN001, ANN201
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")


def wait(client, batch_id: str, until, timeout: float = 180):  # noqa: ANN001, ANN201
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.time() < deadline, f"batch {batch_id} still {batch.status}: {batch.model_extra.get('progress')}"
        time.sleep(0.3)


def worker_metrics(home: Path) -> dict[tuple[str, tuple], float]:
    """What `nightshift metrics` serves on the workers' machine: the samples every worker process
    wrote under <home>/metrics."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(home / "metrics"))
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def test_a_model_that_cannot_load_ends_its_requests_as_model_unavailable(pg_url, s3_server, tmp_path):
    missing = tmp_path / "no-such-model"
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "unavailable", embedding_model=missing,
                             max_shard_attempts=3, model_unavailable_after_seconds=120, **FAST) as (service, client):
        batch = submit(client, embedding_lines(6))
        waiting = wait(client, batch.id, lambda b: (b.model_extra.get("progress") or {}).get("notice"))
        assert waiting.status == "in_progress"
        assert waiting.model_extra["progress"]["notice"].startswith(f"no worker could load model {missing}: ")
        assert waiting.model_extra["progress"]["eta_seconds"] is None
        ended = wait(client, batch.id, lambda b: b.status in ("completed", "failed", "expired", "cancelled"))
        assert ended.status == "failed", ended                  # nothing could run
        assert ended.errors.data[0].code == "model_unavailable" and str(missing) in ended.errors.data[0].message
        assert ended.request_counts.model_dump() == {"total": 6, "completed": 0, "failed": 6}
        lines = [json.loads(x) for x in client.files.content(ended.error_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == [f"doc-{i}" for i in range(6)]
        assert {x["error"]["code"] for x in lines} == {"model_unavailable"}
        assert all(str(missing) in x["error"]["message"] for x in lines)
        samples = worker_metrics(tmp_path)
        failures = sum(v for (name, labels), v in samples.items() if name == "nightshift_engine_load_failures_total"
                       and ("kind", "embeddings") in labels)
        failed_now = [v for (name, labels), v in samples.items() if name == "nightshift_engine_load_failed"
                      and ("kind", "embeddings") in labels]
        assert failures >= 3 and failed_now == [1.0], samples
        log = service.log("worker-gpu")
        assert log.count("cannot load the embeddings model") == 1, log     # said once, not per attempt
        assert "Traceback" not in log
        with session_scope(pg_url) as s:                                    # the worker's engine hosts row
            (host,) = s.scalars(select(EngineHost).where(EngineHost.kind == "embeddings",      # other tests'
                                                         EngineHost.model == str(missing)))  # rows share the database
            assert host.state == "failed" and str(missing) in host.error and host.failures >= 3


def test_a_model_that_appears_while_the_batch_waits_is_loaded_and_the_batch_completes(pg_url, s3_server, tmp_path):
    later = tmp_path / "installed-later"
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "appears", embedding_model=later,
                             max_shard_attempts=50, model_unavailable_after_seconds=300, **FAST) as (service, client):
        batch = submit(client, embedding_lines(5))
        wait(client, batch.id, lambda b: (b.model_extra.get("progress") or {}).get("notice"))
        later.symlink_to(Path(resolve_embedding_model("default")))     # "installed" mid-wait
        ended = wait(client, batch.id, lambda b: b.status in ("completed", "failed", "expired", "cancelled"))
        assert ended.status == "completed" and ended.request_counts.model_dump() == \
            {"total": 5, "completed": 5, "failed": 0}
        assert (ended.model_extra.get("progress") or {}).get("notice") is None
        output = [json.loads(x) for x in client.files.content(ended.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in output) == [f"doc-{i}" for i in range(5)]
        assert "loaded after" in service.log("worker-gpu")

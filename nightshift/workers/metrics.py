"""Worker metrics (Prometheus), multi-process safe: every worker process writes its samples to
files under PROMETHEUS_MULTIPROC_DIR, and one exposition point reads them all (the API's
/metrics on the same machine, or `nightshift metrics` on a machine with workers only).

The directory must be chosen before prometheus_client is imported, so ``use_metrics_dir`` runs
when a worker starts (the Celery ``worker_init`` signal, before the pool forks) and ``serve``
sets it for its whole process tree. Rates are left to PromQL: engine tokens/s is
``rate(nightshift_tokens_total{kind="completion"}[1m])``, the prefix-hit rate
``rate(nightshift_tokens_total{kind="cached"}[5m]) / rate(nightshift_tokens_total{kind="prompt"}[5m])``.
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

from nightshift.settings import Settings

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def use_metrics_dir(settings: Settings) -> str:
    """PROMETHEUS_MULTIPROC_DIR for this process (and its children): the one set by the
    deployment if any, else ``<home>/metrics``."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or str(settings.home.resolve() / "metrics")
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


@lru_cache(maxsize=1)
def worker_metrics() -> SimpleNamespace:
    """The worker-side metrics, created once per process (after the directory is chosen)."""
    from prometheus_client import Counter, Gauge, Histogram

    return SimpleNamespace(
        requests=Counter("nightshift_requests_processed", "Requests answered by engine workers",
                         ["outcome"]),
        tokens=Counter("nightshift_tokens", "Tokens of answered requests (prompt, of those cached, completion)",
                       ["kind"]),
        step_seconds=Histogram("nightshift_engine_step_seconds", "Engine step time", buckets=STEP_BUCKETS),
        step_sequences=Histogram("nightshift_engine_step_sequences", "Sequences per engine step",
                                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
        kv_used=Gauge("nightshift_engine_kv_cache_used_ratio", "Share of the KV-cache blocks in use",
                      multiprocess_mode="livemax"),
        shard_claims=Counter("nightshift_shard_claims", "Shards claimed by engine workers (own: the task's "
                             "shard; ahead: taken ahead to keep the engine full)", ["kind"]),
        shard_retries=Counter("nightshift_shard_retries", "Shard claims that were a repeated attempt"),
        lease_expiries=Counter("nightshift_lease_expiries", "Shard leases found expired by the reconciler"),
        tasks=Counter("nightshift_tasks", "Celery tasks run", ["task", "outcome"]),
        load_failures=Counter("nightshift_engine_load_failures", "Model loads that failed in an engine worker",
                              ["kind", "model"]),
        load_failed=Gauge("nightshift_engine_load_failed", "1 while an engine worker cannot load this model "
                          "(its last load failed), else 0", ["kind", "model"], multiprocess_mode="livemax"),
    )


def observe_step(report) -> None:  # noqa: ANN001 - engine.StepReport
    m = worker_metrics()
    m.step_seconds.observe(report.seconds)
    m.step_sequences.observe(report.sequences)
    m.kv_used.set(report.kv_blocks_used / report.kv_blocks_total if report.kv_blocks_total else 0.0)


def mark_process_dead(pid: int) -> None:
    """A pool child exited: its live gauges stop counting."""
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)


def serve_metrics(settings: Settings, host: str, port: int, stop: threading.Event | None = None) -> None:
    """``nightshift metrics``: serve the samples every worker process on this machine wrote
    (the multiprocess directory) at http://host:port/metrics until ``stop`` is set (forever
    without one). For machines that run workers but no API."""
    path = use_metrics_dir(settings)
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        (stop or threading.Event()).wait()
    finally:
        server.shutdown()
        thread.join(timeout=5)

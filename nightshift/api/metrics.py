"""The API's metrics and GET /metrics (Prometheus text format).

Requests are counted and timed by route template, method and status (a pure ASGI middleware).
The exposition reads every process's samples from PROMETHEUS_MULTIPROC_DIR when it is set (the
API's workers and, on the same machine, the Celery workers: nightshift.workers.metrics), and
adds gauges read from the database and the broker at scrape time: batches and shards by status,
pending requests, webhook deliveries by status, and how many messages wait in each queue.
Expose it to Prometheus only (it needs no key): bind the API to a private network or filter
/metrics at the proxy.
"""
from __future__ import annotations

import os
import time
from functools import lru_cache
from types import SimpleNamespace

from sqlalchemy import func, select
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sqlalchemy.orm import Session

QUEUES = ("gpu", "cpu", "upkeep")


@lru_cache(maxsize=1)
def api_metrics() -> SimpleNamespace:
    from prometheus_client import Counter, Histogram

    return SimpleNamespace(
        requests=Counter("nightshift_http_requests", "HTTP requests answered", ["method", "route", "status"]),
        seconds=Histogram("nightshift_http_request_duration_seconds", "HTTP request time", ["method", "route"],
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)))


class RequestMetrics:
    """Counts and times every HTTP request by its route template (``/v1/batches/{batch_id}``),
    so ids do not explode the label set; unmatched paths count as ``unmatched``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def sending(message) -> None:  # noqa: ANN001
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            m = api_metrics()
            m.requests.labels(scope["method"], route, str(status["code"])).inc()
            m.seconds.labels(scope["method"], route).observe(time.perf_counter() - started)


def service_state(s: Session) -> dict:
    """What the state gauges show, read in one (read-only) session."""
    from nightshift.jobs.batches.models import Batch, Request, RequestStatus, Shard
    from nightshift.jobs.webhooks.models import WebhookDelivery

    return {"batches": s.execute(select(Batch.status, func.count()).group_by(Batch.status)).all(),
            "shards": s.execute(select(Shard.status, func.count()).group_by(Shard.status)).all(),
            "pending": s.scalar(select(func.count()).select_from(Request).where(Request.status == RequestStatus.PENDING)),
            "deliveries": s.execute(select(WebhookDelivery.status, func.count())
                                    .group_by(WebhookDelivery.status)).all()}


class ServiceState:
    """Gauges of what is in the database and the broker at scrape time (a collector: never
    stale, nothing to keep updated)."""

    def __init__(self, state: dict, depths: dict[str, int]):
        self.state, self.depths = state, depths

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import GaugeMetricFamily

        for name, doc, key in (("nightshift_batches", "Batches by status", "batches"),
                               ("nightshift_shards", "Shards by status", "shards"),
                               ("nightshift_webhook_deliveries", "Webhook deliveries by status", "deliveries")):
            family = GaugeMetricFamily(name, doc, labels=["status"])
            for status, count in self.state[key]:
                family.add_metric([status], count)
            yield family
        yield GaugeMetricFamily("nightshift_requests_pending", "Requests not answered yet",
                                value=self.state["pending"] or 0)
        depth = GaugeMetricFamily("nightshift_queue_messages", "Messages waiting in each broker queue",
                                  labels=["queue"])
        for queue, count in self.depths.items():
            depth.add_metric([queue], count)
        yield depth


def queue_depths() -> dict[str, int]:
    from nightshift.workers.celery_app import app
    from nightshift.workers.queue_peek import queued_task_args

    depths = {}
    for queue in QUEUES:
        waiting = queued_task_args(app, queue, None)
        if waiting is not None:
            depths[queue] = len(waiting)
    return depths


def _samples_registry():  # noqa: ANN202 - a prometheus_client registry
    """Every process's samples (the multiprocess directory), else this process's."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def metrics_body(state: dict, depths: dict[str, int]) -> bytes:
    """Every process's samples (from the multiprocess directory, else this process's) and the
    state gauges, in the Prometheus text format."""
    from prometheus_client import CollectorRegistry, generate_latest

    gauges = CollectorRegistry()
    gauges.register(ServiceState(state, depths))
    return generate_latest(_samples_registry()) + generate_latest(gauges)


ENGINE_TOTALS = {("nightshift_tokens_total", "completion"): "completion_tokens",
                 ("nightshift_tokens_total", "prompt"): "prompt_tokens",
                 ("nightshift_requests_processed_total", None): "requests"}


def engine_totals() -> dict[str, float]:
    """The engine workers' counters as /metrics serves them, summed over processes and labels:
    completion and prompt tokens and requests answered so far (a rate is two readings apart)."""
    totals = dict.fromkeys(ENGINE_TOTALS.values(), 0.0)
    for family in _samples_registry().collect():
        for sample in family.samples:
            name = ENGINE_TOTALS.get((sample.name, sample.labels.get("kind"))) or \
                ENGINE_TOTALS.get((sample.name, None))
            if name is not None:
                totals[name] += sample.value
    return totals


def metrics_response(body: bytes) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(body, media_type=CONTENT_TYPE_LATEST)

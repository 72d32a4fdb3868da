"""A batch's cost report from its request rows: cost.json + cost.csv stored at finalize, or a
live report while it runs.

The numbers are sums over `requests` rows. A request row is written once by the shard
attempt that holds the lease (a re-run shard skips answered rows), so re-running a shard or
re-running finalize cannot count anything twice; writing the report twice writes the same
two objects under the same two file ids.
"""
from __future__ import annotations

from typing import Optional

import orjson
from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Request
from nightshift.jobs.costs.accounting import RequestUsage, prices_from_settings
from nightshift.jobs.costs.cost_report import build_cost_report, cost_csv
from nightshift.jobs.files.models import File
from nightshift.jobs.files.service import upsert_result_file
from nightshift.jobs.ids import derived_id
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore

COST_JSON = "cost.json"
COST_CSV = "cost.csv"


def load_usages(session: Session, batch_id: str) -> list[RequestUsage]:
    """One RequestUsage per request row of the batch, in input order."""
    rows = session.execute(
        select(Request.custom_id, Request.line, Request.status, Request.prompt_tokens,
               Request.cached_tokens, Request.completion_tokens, Request.engine_seconds,
               Request.queued_at, Request.started_at, Request.finished_at, Request.worker,
               Request.device, Request.response_status_code)
        .where(Request.batch_id == batch_id).order_by(Request.line))
    # A line never run (drained at cancel/expiry) keeps its planned prompt length in
    # prompt_tokens but consumed nothing: only answered requests (200 or a model 400) count.
    return [RequestUsage(custom_id=r.custom_id, line=r.line, status=r.status,
                         prompt_tokens=(r.prompt_tokens or 0) if r.response_status_code else 0,
                         cached_prompt_tokens=(r.cached_tokens or 0) if r.response_status_code else 0,
                         completion_tokens=(r.completion_tokens or 0) if r.response_status_code else 0,
                         engine_seconds=r.engine_seconds or 0.0, queued_at=r.queued_at,
                         started_at=r.started_at, finished_at=r.finished_at,
                         worker=r.worker, device=r.device)
            for r in rows]


def cost_file_ids(batch_id: str) -> tuple[str, str]:
    """Stable ids of a batch's cost.json and cost.csv (the same on every finalize run)."""
    return derived_id("file-", batch_id, COST_JSON), derived_id("file-", batch_id, COST_CSV)


def cost_object_key(batch_id: str, name: str) -> str:
    return f"batches/{batch_id}/{name}"


def live_cost_report(session: Session, batch: Batch, settings: Settings, now: Optional[float] = None) -> dict:
    usages = load_usages(session, batch.id)
    report = build_cost_report(usages, prices_from_settings(settings, batch.endpoint), batch_id=batch.id,
                               model=batch.model, status=batch.status, generated_at=now)
    json_id, csv_id = cost_file_ids(batch.id)
    stored = session.get(File, json_id) is not None
    report["files"] = {"json": json_id if stored else None, "csv": csv_id if stored else None}
    return report


def write_cost_files(session: Session, store: ObjectStore, batch: Batch, *, settings: Settings,
                     now: float) -> dict:
    """Write cost.json and cost.csv for a batch and register them as files (idempotent).
    Returns the report (with its file ids)."""
    prices = prices_from_settings(settings, batch.endpoint)
    usages = load_usages(session, batch.id)
    json_id, csv_id = cost_file_ids(batch.id)
    report = build_cost_report(usages, prices, batch_id=batch.id, model=batch.model,
                               status=batch.status, generated_at=now)
    report["files"] = {"json": json_id, "csv": csv_id}
    payloads = ((json_id, COST_JSON, orjson.dumps(report, option=orjson.OPT_INDENT_2)),
                (csv_id, COST_CSV, cost_csv(usages, prices)))
    for file_id, name, data in payloads:
        key = cost_object_key(batch.id, name)
        size = store.put_stream(key, data)
        upsert_result_file(session, file_id=file_id, project_id=batch.project_id, filename=f"{batch.id}_{name}",
                           object_key=key, size=size, now=now)
    return report


def stored_cost_report_key(session: Session, batch: Batch) -> Optional[str]:
    """The object key of a finished batch's cost.json, or None while it runs (then the report
    is ``live_cost_report``)."""
    file = session.get(File, cost_file_ids(batch.id)[0])
    return file.object_key if batch.status in BatchStatus.TERMINAL and file is not None else None


def read_cost_report(store: ObjectStore, key: str) -> Optional[dict]:
    """A stored cost.json, or None if its object is gone (recompute it with live_cost_report)."""
    try:
        return orjson.loads(b"".join(store.get_stream(key)))
    except KeyError:
        return None

"""Cost reports from the database: per batch (cost.json + cost.csv at finalize, or live while
running) and per project per day.

The numbers are sums over `requests` rows. A request row is written once by the shard
attempt that holds the lease (a re-run shard skips answered rows), so re-running a shard or
re-running finalize cannot count anything twice; writing the report twice writes the same
two objects under the same two file ids.
"""
from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Optional

import orjson
from sqlalchemy import Integer, cast, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.costs import Prices, RequestUsage, build_cost_report, cost_csv, online_cost_usd
from nightshift.jobs.ids import derived_id
from nightshift.jobs.models import Batch, BatchStatus, File, Request
from nightshift.settings import Settings, get_settings
from nightshift.storage.objectstore import ObjectStore

COST_JSON = "cost.json"
COST_CSV = "cost.csv"
DAY = 86_400


def prices_from_settings(settings: Optional[Settings] = None) -> Prices:
    settings = settings or get_settings()
    return Prices(instance_usd_per_hour=dict(settings.instance_usd_per_hour),
                  online_input_usd_per_1m=settings.online_input_usd_per_1m,
                  online_cached_input_usd_per_1m=settings.online_cached_input_usd_per_1m,
                  online_output_usd_per_1m=settings.online_output_usd_per_1m)


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


def live_cost_report(session: Session, batch: Batch, settings: Optional[Settings] = None,
                     now: Optional[float] = None) -> dict:
    usages = load_usages(session, batch.id)
    report = build_cost_report(usages, prices_from_settings(settings), batch_id=batch.id,
                               model=batch.model, status=batch.status, generated_at=now)
    json_id, csv_id = cost_file_ids(batch.id)
    stored = session.get(File, json_id) is not None
    report["files"] = {"json": json_id if stored else None, "csv": csv_id if stored else None}
    return report


def _upsert_file(session: Session, *, file_id: str, batch: Batch, filename: str, key: str,
                 size: int, now: float) -> None:
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(File).values(id=file_id, project_id=batch.project_id, filename=filename,
                               purpose="batch_output", bytes=size, object_key=key,
                               status="processed", created_at=now)
    session.execute(stmt.on_conflict_do_update(index_elements=["id"],
                                               set_={"bytes": size, "object_key": key}))


def write_cost_files(session: Session, store: ObjectStore, batch: Batch, *,
                     settings: Optional[Settings] = None, now: float) -> dict:
    """Write cost.json and cost.csv for a batch and register them as files (idempotent).
    Returns the report (with its file ids)."""
    prices = prices_from_settings(settings)
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
        _upsert_file(session, file_id=file_id, batch=batch, filename=f"{batch.id}_{name}",
                     key=key, size=size, now=now)
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


# --- per project per day ----------------------------------------------------------------------

def _day_expr(session: Session):
    # floor(finished_at / 86400): Postgres casts by rounding, SQLite by truncating
    if session.get_bind().dialect.name == "postgresql":
        return cast(func.floor(Request.finished_at / DAY), Integer)
    return cast(Request.finished_at / DAY, Integer)


def costs_by_day(session: Session, project_id: str, *, start: float, end: float,
                 settings: Optional[Settings] = None) -> dict:
    """Cost of the project's answered requests that finished in [start, end), per UTC day
    (never-run lines of cancelled/expired batches consumed nothing and are left out)."""
    prices = prices_from_settings(settings)
    day = _day_expr(session).label("day")
    rows = session.execute(
        select(day, Request.device, func.count().label("requests"),
               func.coalesce(func.sum(Request.prompt_tokens), 0).label("prompt_tokens"),
               func.coalesce(func.sum(Request.cached_tokens), 0).label("cached_tokens"),
               func.coalesce(func.sum(Request.completion_tokens), 0).label("completion_tokens"),
               func.coalesce(func.sum(Request.engine_seconds), 0.0).label("engine_seconds"))
        .join(Batch, Batch.id == Request.batch_id)
        .where(Batch.project_id == project_id, Request.response_status_code.is_not(None),
               Request.finished_at >= start, Request.finished_at < end)
        .group_by(day, Request.device).order_by(day)).all()
    days: dict[int, dict] = {}
    batches_per_day = dict(session.execute(
        select(day, func.count(func.distinct(Request.batch_id)))
        .join(Batch, Batch.id == Request.batch_id)
        .where(Batch.project_id == project_id, Request.response_status_code.is_not(None),
               Request.finished_at >= start, Request.finished_at < end)
        .group_by(day)).all())
    for r in rows:
        entry = days.setdefault(int(r.day), {
            "date": datetime.fromtimestamp(int(r.day) * DAY, timezone.utc).date().isoformat(),
            "project_id": project_id, "batches": batches_per_day.get(r.day, 0), "requests": 0,
            "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0,
            "engine_seconds": [], "cost_usd": []})
        entry["requests"] += r.requests
        entry["prompt_tokens"] += int(r.prompt_tokens)
        entry["cached_prompt_tokens"] += int(r.cached_tokens)
        entry["completion_tokens"] += int(r.completion_tokens)
        entry["engine_seconds"].append(float(r.engine_seconds))
        price = prices.hourly_price(r.device)
        if r.engine_seconds and price is not None:
            entry["cost_usd"].append(float(r.engine_seconds) * price / 3600.0)
    data = []
    for entry in days.values():
        entry["engine_seconds"] = math.fsum(entry["engine_seconds"])
        entry["cost_usd"] = math.fsum(entry["cost_usd"])
        entry["online_list_usd"] = online_cost_usd(entry["prompt_tokens"], entry["cached_prompt_tokens"],
                                                   entry["completion_tokens"], prices)
        entry["savings_vs_online_list_usd"] = entry["online_list_usd"] - entry["cost_usd"]
        data.append(entry)
    totals = {key: sum(d[key] for d in data) for key in
              ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")}
    for key in ("engine_seconds", "cost_usd", "online_list_usd", "savings_vs_online_list_usd"):
        totals[key] = math.fsum(d[key] for d in data)
    return {"object": "list", "project_id": project_id, "from": start, "to": end,
            "currency": "USD", "data": data, "total": totals}

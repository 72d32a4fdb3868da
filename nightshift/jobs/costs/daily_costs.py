"""Spend per project per UTC day, summed in the database over answered request rows."""
from __future__ import annotations

import math
from datetime import datetime, timezone

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, Request
from nightshift.jobs.costs.accounting import online_cost_usd, prices_from_settings
from nightshift.settings import Settings

DAY = 86_400


def _day_expr(session: Session):
    # floor(finished_at / 86400): Postgres casts by rounding, SQLite by truncating
    if session.get_bind().dialect.name == "postgresql":
        return cast(func.floor(Request.finished_at / DAY), Integer)
    return cast(Request.finished_at / DAY, Integer)


def costs_by_day(session: Session, project_id: str, *, start: float, end: float, settings: Settings) -> dict:
    """Cost of the project's answered requests that finished in [start, end), per UTC day
    (never-run lines of cancelled/expired batches consumed nothing and are left out). The
    online list price of each endpoint's tokens is its own (prices_from_settings)."""
    prices = {}
    day = _day_expr(session).label("day")
    rows = session.execute(
        select(day, Request.device, Batch.endpoint, func.count().label("requests"),
               func.coalesce(func.sum(Request.prompt_tokens), 0).label("prompt_tokens"),
               func.coalesce(func.sum(Request.cached_tokens), 0).label("cached_tokens"),
               func.coalesce(func.sum(Request.completion_tokens), 0).label("completion_tokens"),
               func.coalesce(func.sum(Request.engine_seconds), 0.0).label("engine_seconds"))
        .join(Batch, Batch.id == Request.batch_id)
        .where(Batch.project_id == project_id, Request.response_status_code.is_not(None),
               Request.finished_at >= start, Request.finished_at < end)
        .group_by(day, Request.device, Batch.endpoint).order_by(day)).all()
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
            "engine_seconds": [], "cost_usd": [], "online_list_usd": []})
        if r.endpoint not in prices:
            prices[r.endpoint] = prices_from_settings(settings, r.endpoint)
        row_prices = prices[r.endpoint]
        entry["requests"] += r.requests
        entry["prompt_tokens"] += int(r.prompt_tokens)
        entry["cached_prompt_tokens"] += int(r.cached_tokens)
        entry["completion_tokens"] += int(r.completion_tokens)
        entry["engine_seconds"].append(float(r.engine_seconds))
        price = row_prices.hourly_price(r.device)
        if r.engine_seconds and price is not None:
            entry["cost_usd"].append(float(r.engine_seconds) * price / 3600.0)
        entry["online_list_usd"].append(online_cost_usd(int(r.prompt_tokens), int(r.cached_tokens),
                                                        int(r.completion_tokens), row_prices))
    data = []
    for entry in days.values():
        entry["engine_seconds"] = math.fsum(entry["engine_seconds"])
        entry["cost_usd"] = math.fsum(entry["cost_usd"])
        entry["online_list_usd"] = math.fsum(entry["online_list_usd"])
        entry["savings_vs_online_list_usd"] = entry["online_list_usd"] - entry["cost_usd"]
        data.append(entry)
    totals = {key: sum(d[key] for d in data) for key in
              ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")}
    for key in ("engine_seconds", "cost_usd", "online_list_usd", "savings_vs_online_list_usd"):
        totals[key] = math.fsum(d[key] for d in data)
    return {"object": "list", "project_id": project_id, "from": start, "to": end,
            "currency": "USD", "data": data, "total": totals}


def every_day(report: dict) -> list[dict]:
    """``costs_by_day``'s days with the days of its window that had no answered request put in at
    zero, oldest first (a chart's continuous axis)."""
    have = {d["date"]: d for d in report["data"]}
    first, last = int(report["from"] // DAY), int(math.ceil(report["to"] / DAY)) - 1
    days = []
    for day in range(first, last + 1):
        date = datetime.fromtimestamp(day * DAY, timezone.utc).date().isoformat()
        days.append(have.get(date) or {
            "date": date, "project_id": report["project_id"], "batches": 0, "requests": 0, "prompt_tokens": 0,
            "cached_prompt_tokens": 0, "completion_tokens": 0, "engine_seconds": 0.0, "cost_usd": 0.0,
            "online_list_usd": 0.0, "savings_vs_online_list_usd": 0.0})
    return days

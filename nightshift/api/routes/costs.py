"""Cost routes: a batch's cost report (JSON, or the HTML page) and costs per day."""
from __future__ import annotations

import time
from datetime import date, datetime, timezone
from typing import Literal, Optional

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nightshift.api.deps import CallerDep, ProjectCaller, SettingsDep, StoreDep
from nightshift.jobs.batches.service import get_batch
from nightshift.jobs.costs.batch_costs import live_cost_report, read_cost_report, stored_cost_report_key
from nightshift.jobs.costs.daily_costs import costs_by_day
from nightshift.jobs.costs.html_page import render_cost_page
from nightshift.jobs.errors import InvalidInput
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore

router = APIRouter(tags=["costs"])
DEFAULT_DAYS = 30


@router.get("/v1/batches/{batch_id}/cost", response_model=None)
async def batch_cost(batch_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
                     format: Literal["json", "html"] = "json") -> JSONResponse | HTMLResponse:
    """cost.json of a finished batch (a live report while it runs); ?format=html for the page."""
    report = await cost_report(caller, store, settings, batch_id)
    if format == "html":
        return HTMLResponse(render_cost_page(report))
    return JSONResponse(report)


async def cost_report(caller: ProjectCaller, store: ObjectStore, settings: Settings, batch_id: str) -> dict:
    """The batch's cost report: its stored cost.json once it has ended, else a live one from its
    request rows (the API's and the console's)."""
    def live_report(session: Session, project_id: str) -> dict:
        return live_cost_report(session, get_batch(session, project_id, batch_id), settings, now=time.time())

    key = await caller.read(lambda session, project_id:
                            stored_cost_report_key(session, get_batch(session, project_id, batch_id)))
    # A finished batch's stored report is read with no database connection held.
    report = await run_in_threadpool(read_cost_report, store, key) if key else None
    if report is None:
        report = await caller.read(live_report)
    return report


def _instant(value: Optional[str], param: str) -> Optional[float]:
    """Unix seconds, or an ISO date (YYYY-MM-DD, UTC midnight) / ISO datetime."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        if len(value) == 10:
            return datetime.combine(date.fromisoformat(value), datetime.min.time(), timezone.utc).timestamp()
        parsed = datetime.fromisoformat(value)
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
    except ValueError as exc:
        raise InvalidInput(f"'{param}' must be Unix seconds or an ISO date such as 2026-11-22 "
                           f"(got {value!r}).", param, "invalid_value") from exc


@router.get("/v1/costs")
async def costs(caller: CallerDep, settings: SettingsDep,
                from_: Optional[str] = Query(None, alias="from"), to: Optional[str] = None) -> dict:
    """Spend of the caller's project per UTC day, for requests finished in [from, to)
    (default: the last 30 days)."""
    end = _instant(to, "to") or time.time()
    start = _instant(from_, "from")
    start = end - DEFAULT_DAYS * 86400 if start is None else start
    if start >= end:
        raise InvalidInput("'from' must be before 'to'.", "from", "invalid_value")
    return await caller.read(lambda session, project_id: costs_by_day(session, project_id, start=start, end=end,
                                                                      settings=settings))

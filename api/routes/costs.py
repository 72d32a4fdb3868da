"""Cost routes (issue 6): a batch's cost report (JSON, or the HTML page) and costs per day."""
from __future__ import annotations

import time
from datetime import date, datetime, timezone
from typing import Literal, Optional

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, JSONResponse

from api.deps import ProjectDep, SessionDep, SettingsDep, StoreDep
from jobs import batch_queries
from jobs.cost_page import render_cost_page
from jobs.cost_reports import batch_cost_report, costs_by_day
from jobs.errors import InvalidInput

router = APIRouter(tags=["costs"])
DEFAULT_DAYS = 30


@router.get("/v1/batches/{batch_id}/cost", response_model=None)
def batch_cost(batch_id: str, project_id: ProjectDep, session: SessionDep, store: StoreDep,
               settings: SettingsDep,
               format: Literal["json", "html"] = "json") -> JSONResponse | HTMLResponse:
    """cost.json of a finished batch (a live report while it runs); ?format=html for the page."""
    batch = batch_queries.get_batch(session, project_id, batch_id)
    report = batch_cost_report(session, store, batch, settings, now=time.time())
    if format == "html":
        return HTMLResponse(render_cost_page(report))
    return JSONResponse(report)


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
def costs(project_id: ProjectDep, session: SessionDep, settings: SettingsDep,
          from_: Optional[str] = Query(None, alias="from"), to: Optional[str] = None) -> dict:
    """Spend of the caller's project per UTC day, for requests finished in [from, to)
    (default: the last 30 days)."""
    end = _instant(to, "to") or time.time()
    start = _instant(from_, "from")
    start = end - DEFAULT_DAYS * 86400 if start is None else start
    if start >= end:
        raise InvalidInput("'from' must be before 'to'.", "from", "invalid_value")
    return costs_by_day(session, project_id, start=start, end=end, settings=settings)

"""The console's pages (GET): batches, one batch, schedules, costs, health. Each reads through
the session's caller and the same jobs/ functions as the JSON API; no SQL here."""
from __future__ import annotations

import math
import time
from datetime import date, datetime, timezone
from typing import Optional
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from markupsafe import Markup
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.responses import RedirectResponse, Response

from nightshift.api.console import views
from nightshift.api.console.health import METER, health_view
from nightshift.api.console.rendering import SECURITY_HEADERS, ConsoleRoute, render
from nightshift.api.console.sessions import SessionCaller, ViewerDep
from nightshift.api.deps import SettingsDep, StoreDep
from nightshift.api.metrics import queue_depths
from nightshift.api.routes.costs import cost_report
from nightshift.api.routes.files import file_download
from nightshift.jobs.batches import service as batch_service
from nightshift.jobs.batches.error_lines import first_error_lines, validation_errors
from nightshift.jobs.batches.models import BatchStatus
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.costs.daily_costs import DAY, costs_by_day, every_day
from nightshift.jobs.costs.formatting import DEVICE_COLUMNS, device_rows, key_figures
from nightshift.jobs.costs.html_page import daily_costs_chart, timeline_chart
from nightshift.jobs.costs.running_costs import costs_so_far
from nightshift.jobs.engine_hosts.registry import hosts_seen
from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.files.service import files_by_id
from nightshift.jobs.schedules import service as schedules
from nightshift.settings import Settings

router = APIRouter(prefix="/console", route_class=ConsoleRoute)

COST_DAY_CHOICES = (7, 30, 90)
HOSTS_SEEN_SECONDS = 3600


def _day(value: str, param: str) -> Optional[float]:
    """A YYYY-MM-DD date as Unix seconds at its UTC midnight ('' : none)."""
    if not value:
        return None
    try:
        return datetime.combine(date.fromisoformat(value), datetime.min.time(), timezone.utc).timestamp()
    except ValueError:
        raise InvalidInput(f"'{param}' must be a date such as 2026-11-22 (got {value!r}).", param,
                           "invalid_value") from None


@router.get("")
async def batches_page(request: Request, caller: ViewerDep, settings: SettingsDep, status: str = "",
                       from_: str = Query("", alias="from"), to: str = "", after: Optional[str] = None,
                       limit: int = Query(20, ge=1, le=100)) -> Response:
    """The project's batches, newest first, with live progress; filtered by status and creation date."""
    created_from, to_day = _day(from_, "from"), _day(to, "to")
    created_before = to_day + DAY if to_day is not None else None       # 'to' is inclusive
    if created_from is not None and created_before is not None and created_from >= created_before:
        raise InvalidInput("'from' must not be after 'to'.", "from", "invalid_value")

    def page(session: Session, project_id: str) -> tuple[list[dict], bool]:
        batches, has_more = batch_service.list_batches(
            session, project_id, after=after, limit=limit, statuses=[status] if status else None,
            created_from=created_from, created_before=created_before)
        progress = batch_progress(session, batches)
        costs = costs_so_far(session, batches, settings)
        return [views.batch_row(b, progress[b.id], costs[b.id]) for b in batches], has_more

    rows, has_more = await caller.read(page)
    filters = {"status": status, "from": from_, "to": to, "after": after}
    kept = {k: v for k, v in (("status", status), ("from", from_), ("to", to)) if v}
    if limit != 20:
        kept["limit"] = str(limit)
    next_url = f"/console?{urlencode({**kept, 'after': rows[-1]['doc']['id']})}" if has_more and rows else None
    return render(request, "batches.html", session=caller.info, nav="batches", rows=rows, filters=filters,
                  statuses=BatchStatus.ALL, next_url=next_url,
                  first_url="/console" + (f"?{urlencode(kept)}" if kept else ""),
                  poll_seconds=settings.console_poll_seconds)


@router.get("/batches/{batch_id}")
async def batch_page(request: Request, batch_id: str, caller: ViewerDep, store: StoreDep,
                     settings: SettingsDep) -> Response:
    """One batch: counts, timeline, usage, the cost report and chart, files, first errors, actions."""
    def gather(session: Session, project_id: str):  # noqa: ANN202
        batch = batch_service.get_batch(session, project_id, batch_id)
        progress = batch_progress(session, [batch])[batch.id]
        cost = costs_so_far(session, [batch], settings)[batch.id]
        return batch, progress, cost, first_error_lines(session, batch)

    batch, progress, cost, error_lines = await caller.read(gather)
    report = await cost_report(caller, store, settings, batch_id)
    files = await caller.read(lambda session, project_id:
                              files_by_id(session, project_id, views.download_ids(batch, report)))
    return render(request, "batch.html", session=caller.info, nav="batches", batch=batch,
                  live=views.live_view(batch, progress, cost), timeline=views.state_timeline(batch),
                  cancellable=views.can_cancel(batch), retryable=views.can_retry(batch, progress),
                  retry_of=views.link_of(batch, "retry_of"), retried_by=views.link_of(batch, "retried_by"),
                  downloads=views.downloads(batch, report, files), error_lines=error_lines,
                  validation_errors=validation_errors(batch), report=report,
                  report_stored=batch.status in BatchStatus.TERMINAL and bool((report.get("files") or {}).get("json")),
                  chart=Markup(timeline_chart(report.get("timeline") or [])), figures=key_figures(report),
                  devices=device_rows(report), device_columns=DEVICE_COLUMNS,
                  poll_seconds=settings.console_poll_seconds)


@router.get("/schedules")
async def schedules_page(request: Request, caller: ViewerDep, after: Optional[str] = None) -> Response:
    """The project's schedules: cron, next due time, the last runs with their batches, on/off."""
    def gather(session: Session, project_id: str):  # noqa: ANN202
        rows, has_more = schedules.list_schedules(session, project_id, after=after, limit=20)
        return [(s, schedules.list_runs(session, s, limit=5)) for s in rows], has_more

    listed, has_more = await caller.read(gather)
    next_url = f"/console/schedules?{urlencode({'after': listed[-1][0].id})}" if has_more and listed else None
    return render(request, "schedules.html", session=caller.info, nav="schedules", schedules=listed,
                  after=after, next_url=next_url)


@router.get("/costs")
async def costs_page(request: Request, caller: ViewerDep, settings: SettingsDep, days: int = 30) -> Response:
    """The project's daily costs over the last ``days`` UTC days (today included), against list prices."""
    if days not in COST_DAY_CHOICES:
        raise InvalidInput(f"'days' must be one of {', '.join(map(str, COST_DAY_CHOICES))} (got {days}).", "days",
                           "invalid_value")
    end = time.time()
    start = (math.floor(end / DAY) - days + 1) * DAY
    report = await caller.read(lambda session, project_id:
                               costs_by_day(session, project_id, start=start, end=end, settings=settings))
    every = every_day(report)
    return render(request, "costs.html", session=caller.info, nav="costs", days=days, day_choices=COST_DAY_CHOICES,
                  total=report["total"], rows=list(reversed(report["data"])),
                  chart=Markup(daily_costs_chart(every)), prices=settings.instance_usd_per_hour)


async def health_figures(caller: SessionCaller, settings: Settings) -> tuple[list, dict]:
    """The engine workers seen (our heartbeat) and the live figures (queues, throughput)."""
    hosts = await caller.read(lambda session, project_id:
                              hosts_seen(session, time.time(), settings.engine_host_stale_seconds, HOSTS_SEEN_SECONDS))
    depths = await run_in_threadpool(queue_depths)
    rates = await run_in_threadpool(METER.rates)
    return hosts, health_view(rates, depths)


@router.get("/health")
async def health_page(request: Request, caller: ViewerDep, settings: SettingsDep) -> Response:
    """Engine workers seen, queue depths, the engine's throughput."""
    hosts, view = await health_figures(caller, settings)
    return render(request, "health.html", session=caller.info, nav="health", hosts=hosts, view=view,
                  stale_seconds=settings.engine_host_stale_seconds)


@router.get("/files/{file_id}/content")
async def download(file_id: str, caller: ViewerDep, store: StoreDep) -> Response:
    """A file of the project (a batch's input, output, errors, cost report), as the API serves it."""
    return await file_download(caller, store, file_id)


@router.get("/{path:path}")
async def no_such_page(request: Request, path: str) -> Response:
    if path == "":
        return RedirectResponse("/console", status_code=308, headers=SECURITY_HEADERS)
    return render(request, "error.html", status=404, session=None, nav=None, title="Not found",
                  message=f"There is no console page at /console/{path}.")

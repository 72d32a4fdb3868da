"""What the pages poll (JSON, GET): their batches' progress, and the health figures. One small
request per open page every ``console_poll_seconds`` (the script stops while the page is hidden
or every batch on it has ended); a poll is four short statements (session, batches, their shard
sums, their engine seconds by device)."""
from __future__ import annotations

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session
from starlette.responses import Response

from nightshift.api.console import views
from nightshift.api.console.pages import health_figures
from nightshift.api.console.rendering import ConsoleRoute, json_answer
from nightshift.api.console.sessions import PREFIX, ViewerDep
from nightshift.api.deps import SettingsDep
from nightshift.jobs.batches import service as batch_service
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.costs.running_costs import costs_so_far
from nightshift.jobs.errors import InvalidInput

router = APIRouter(prefix=f"{PREFIX}/api", route_class=ConsoleRoute)


@router.get("/progress")
async def progress(caller: ViewerDep, settings: SettingsDep, ids: str = Query(...)) -> Response:
    """The live figures of the project's batches ``ids`` (comma-separated; another project's is 404)."""
    batch_ids = [part for part in ids.split(",") if part]
    if not batch_ids:
        raise InvalidInput("'ids' must name at least one batch.", "ids", "invalid_value")

    def read(session: Session, project_id: str) -> dict:
        batches = batch_service.get_batches(session, project_id, batch_ids)
        progress_of = batch_progress(session, batches)
        costs = costs_so_far(session, batches, settings)
        return {b.id: views.live_view(b, progress_of[b.id], costs[b.id]) for b in batches}

    return json_answer({"batches": await caller.read(read)})


@router.get("/health")
async def health(caller: ViewerDep, settings: SettingsDep) -> Response:
    _, view = await health_figures(caller, settings)
    return json_answer(view)

"""/v1/schedules: CRUD, pause/resume, runs. A key sees only its project's schedules."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from nightshift.api.deps import CallerDep, SettingsDep
from nightshift.api.schemas.common import ListPage
from nightshift.api.schemas.schedules import (ScheduleCreate, ScheduleDeleted, ScheduleObject, ScheduleRunObject,
                                   ScheduleUpdate)
from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.schedules import service as schedules
from nightshift.jobs.schedules.models import Schedule, ScheduleRun, ScheduleStatus
from nightshift.settings import Settings

router = APIRouter(prefix="/v1/schedules", tags=["schedules"])


def _now() -> float:
    import time

    return time.time()


def schedule_object(s: Schedule) -> ScheduleObject:
    return ScheduleObject(
        id=s.id, name=s.name, cron=s.cron, timezone=s.timezone, status=s.status, endpoint=s.endpoint,
        model=s.model, source=s.source, prompt_template=s.prompt_template, index_prefix=s.index_prefix,
        completion_window=s.completion_window, metadata=s.metadata_,
        next_run_at=int(s.next_due_at) if s.status == ScheduleStatus.ACTIVE else None,
        created_at=int(s.created_at), updated_at=int(s.updated_at))


def run_object(r: ScheduleRun) -> ScheduleRunObject:
    return ScheduleRunObject(
        id=r.id, schedule_id=r.schedule_id, due_at=int(r.due_at), fired_at=int(r.fired_at), status=r.status,
        batch_id=r.batch_id, input_file_id=r.input_file_id, documents_total=r.documents_total,
        documents_selected=r.documents_selected, documents_indexed=r.documents_indexed,
        documents_failed=r.documents_failed, documents_removed=r.documents_removed, error=r.error,
        finished_at=int(r.finished_at) if r.finished_at is not None else None)


def _check_model(model: str, settings: Settings) -> None:
    if model not in settings.accepted_model_names():
        raise InvalidInput(f"The model '{model}' does not exist; this server serves "
                           f"{sorted(settings.accepted_model_names())}.", "model", "model_not_found")


@router.post("", response_model=ScheduleObject)
async def create_schedule(body: ScheduleCreate, caller: CallerDep, settings: SettingsDep) -> ScheduleObject:
    _check_model(body.model, settings)

    def create(session: Session, project_id: str) -> ScheduleObject:
        return schedule_object(schedules.create_schedule(
            session, project_id=project_id, name=body.name, cron=body.cron, timezone_name=body.timezone,
            endpoint=body.endpoint, model=body.model, source=body.source.model_dump(),
            prompt_template=body.prompt_template, index_prefix=body.index_prefix,
            completion_window=body.completion_window, metadata=body.metadata, now=_now()))

    return await caller.run(create)


@router.get("", response_model=ListPage[ScheduleObject])
async def list_schedules(caller: CallerDep, after: Optional[str] = None,
                         limit: int = Query(20, ge=1, le=100)) -> ListPage[ScheduleObject]:
    def page(session: Session, project_id: str) -> ListPage[ScheduleObject]:
        rows, has_more = schedules.list_schedules(session, project_id, after=after, limit=limit)
        return ListPage[ScheduleObject].of([schedule_object(s) for s in rows], has_more)

    return await caller.read(page)


@router.get("/{schedule_id}", response_model=ScheduleObject)
async def retrieve_schedule(schedule_id: str, caller: CallerDep) -> ScheduleObject:
    return await caller.read(lambda session, project_id:
                             schedule_object(schedules.get_schedule(session, project_id, schedule_id)))


@router.post("/{schedule_id}", response_model=ScheduleObject)
@router.patch("/{schedule_id}", response_model=ScheduleObject, include_in_schema=False)
async def update_schedule(schedule_id: str, body: ScheduleUpdate, caller: CallerDep,
                          settings: SettingsDep) -> ScheduleObject:
    changes = body.model_dump(exclude_unset=True)
    if changes.get("model") is not None:
        _check_model(changes["model"], settings)
    return await caller.run(lambda session, project_id: schedule_object(schedules.update_schedule(
        session, schedules.get_schedule(session, project_id, schedule_id), changes, now=_now())))


@router.delete("/{schedule_id}", response_model=ScheduleDeleted)
async def delete_schedule(schedule_id: str, caller: CallerDep) -> ScheduleDeleted:
    await caller.run(lambda session, project_id:
                     schedules.delete_schedule(session, schedules.get_schedule(session, project_id, schedule_id)))
    return ScheduleDeleted(id=schedule_id)


@router.post("/{schedule_id}/pause", response_model=ScheduleObject)
async def pause_schedule(schedule_id: str, caller: CallerDep) -> ScheduleObject:
    return await caller.run(lambda session, project_id: schedule_object(schedules.pause_schedule(
        session, schedules.get_schedule(session, project_id, schedule_id), now=_now())))


@router.post("/{schedule_id}/resume", response_model=ScheduleObject)
async def resume_schedule(schedule_id: str, caller: CallerDep) -> ScheduleObject:
    return await caller.run(lambda session, project_id: schedule_object(schedules.resume_schedule(
        session, schedules.get_schedule(session, project_id, schedule_id), now=_now())))


@router.get("/{schedule_id}/runs", response_model=ListPage[ScheduleRunObject])
async def list_runs(schedule_id: str, caller: CallerDep,
                    limit: int = Query(100, ge=1, le=1000)) -> ListPage[ScheduleRunObject]:
    def page(session: Session, project_id: str) -> ListPage[ScheduleRunObject]:
        runs = schedules.list_runs(session, schedules.get_schedule(session, project_id, schedule_id), limit=limit)
        return ListPage[ScheduleRunObject].of([run_object(r) for r in runs], False)

    return await caller.read(page)

"""Schedules as the API manages them: create (validated), update, pause/resume, delete, get,
list, and list a schedule's runs. Firing is in ``firing``; a run's life in ``runs``.

All functions take `now` (Unix seconds) from the caller, so tests drive a fake clock.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.openai_mapping import ENDPOINTS
from nightshift.jobs.errors import Conflict, NotFound
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.schedules.cron import InvalidScheduleError, next_due_at, validate_cron
from nightshift.jobs.schedules.models import Schedule, ScheduleRun, ScheduleStatus
from nightshift.jobs.schedules.reindex import TemplateRenderError, check_prompt_template, normalize_prefix

# documents: every object is one document (rendered by prompt_template);
# jsonl: every line of every .jsonl object is one complete request, keyed by custom_id
SOURCE_FORMATS = ("documents", "jsonl")


class ScheduleNotFound(NotFound):
    def __init__(self, schedule_id: str):
        super().__init__("schedule", schedule_id)


class ScheduleConflict(Conflict):
    pass


def _check_source(session: Session, project_id: str, source: Any,
                  prompt_template: Any) -> dict:
    if not isinstance(source, dict) or source.get("type") not in ("prefix", "file"):
        raise InvalidScheduleError(
            "source", "source must be {\"type\": \"prefix\", \"prefix\": ..., \"format\": \"documents\"|"
                      "\"jsonl\"} (objects under an object-store prefix) or {\"type\": \"file\", "
                      "\"file_id\": ...} (a stored JSONL file)")
    if source["type"] == "prefix":
        prefix = source.get("prefix")
        if not isinstance(prefix, str) or not prefix.strip("/ "):
            raise InvalidScheduleError("source.prefix", "source.prefix must be a non-empty string")
        source_format = source.get("format", "documents")
        if source_format not in SOURCE_FORMATS:
            raise InvalidScheduleError("source.format", f"source.format must be one of {list(SOURCE_FORMATS)}")
        if source_format == "jsonl":
            if prompt_template is not None:
                raise InvalidScheduleError("prompt_template", "a jsonl source holds complete request lines; "
                                                              "omit prompt_template")
            return {"type": "prefix", "prefix": normalize_prefix(prefix), "format": "jsonl"}
        if prompt_template is None:
            raise InvalidScheduleError(
                "prompt_template", "a prefix source needs a prompt_template (the request body, "
                                   "with {{ document }} where the document text goes)")
        try:
            check_prompt_template(prompt_template)
        except TemplateRenderError as exc:
            raise InvalidScheduleError("prompt_template", str(exc)) from exc
        return {"type": "prefix", "prefix": normalize_prefix(prefix), "format": "documents"}
    file_id = source.get("file_id")
    if not isinstance(file_id, str):
        raise InvalidScheduleError("source.file_id", "source.file_id must be a file id")
    file = session.get(File, file_id)
    if file is None or file.project_id != project_id or file.deleted_at is not None:
        raise InvalidScheduleError("source.file_id", f"no such file: {file_id!r}")
    if prompt_template is not None:
        raise InvalidScheduleError("prompt_template",
                                   "a file source holds complete request lines; omit prompt_template")
    return {"type": "file", "file_id": file_id}


def _check_fields(*, name: str, cron: str, timezone_name: str, endpoint: str,
                  completion_window: str, metadata: Optional[dict]) -> None:
    if not name or len(name) > 200:
        raise InvalidScheduleError("name", "name must be 1 to 200 characters")
    validate_cron(cron, timezone_name)
    if endpoint not in ENDPOINTS:
        raise InvalidScheduleError("endpoint", f"endpoint must be one of {list(ENDPOINTS)}")
    if completion_window != "24h":
        raise InvalidScheduleError("completion_window", "completion_window must be '24h'")
    # each run's batch adds schedule_id and schedule_run_id to these (OpenAI's limit is 16)
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 14 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):
        raise InvalidScheduleError("metadata", "metadata must be an object of at most 14 string pairs "
                                               "(keys up to 64, values up to 512 characters)")


def create_schedule(session: Session, *, project_id: str, name: str, cron: str,
                    timezone_name: str = "UTC", endpoint: str, model: str, source: Any,
                    prompt_template: Any = None, index_prefix: Optional[str] = None,
                    completion_window: str = "24h", metadata: Optional[dict] = None,
                    now: float) -> Schedule:
    _check_fields(name=name, cron=cron, timezone_name=timezone_name, endpoint=endpoint,
                  completion_window=completion_window, metadata=metadata)
    clean_source = _check_source(session, project_id, source, prompt_template)
    if session.scalar(select(Schedule.id).where(Schedule.project_id == project_id,
                                                Schedule.name == name)):
        raise ScheduleConflict(f"a schedule named {name!r} already exists")
    schedule_id = new_id("sched_")
    schedule = Schedule(
        id=schedule_id, project_id=project_id, name=name, cron=cron, timezone=timezone_name,
        status=ScheduleStatus.ACTIVE, endpoint=endpoint, model=model, source=clean_source,
        prompt_template=prompt_template,
        index_prefix=normalize_prefix(index_prefix or f"index/{schedule_id}/"),
        completion_window=completion_window, metadata_=metadata,
        fire_after=now, next_due_at=next_due_at(cron, timezone_name, now),
        created_at=now, updated_at=now)
    session.add(schedule)
    session.flush()
    return schedule


UPDATABLE = ("name", "cron", "timezone", "endpoint", "model", "source", "prompt_template",
             "index_prefix", "completion_window", "metadata")


def update_schedule(session: Session, schedule: Schedule, changes: dict, *, now: float) -> Schedule:
    unknown = set(changes) - set(UPDATABLE)
    if unknown:
        raise InvalidScheduleError(sorted(unknown)[0], f"cannot update {sorted(unknown)}")
    merged = {
        "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone,
        "endpoint": schedule.endpoint, "model": schedule.model, "source": schedule.source,
        "prompt_template": schedule.prompt_template, "index_prefix": schedule.index_prefix,
        "completion_window": schedule.completion_window, "metadata": schedule.metadata_,
    } | changes
    _check_fields(name=merged["name"], cron=merged["cron"], timezone_name=merged["timezone"],
                  endpoint=merged["endpoint"], completion_window=merged["completion_window"],
                  metadata=merged["metadata"])
    source = _check_source(session, schedule.project_id, merged["source"], merged["prompt_template"])
    if merged["name"] != schedule.name and session.scalar(
            select(Schedule.id).where(Schedule.project_id == schedule.project_id,
                                      Schedule.name == merged["name"])):
        raise ScheduleConflict(f"a schedule named {merged['name']!r} already exists")
    schedule.name, schedule.cron, schedule.timezone = merged["name"], merged["cron"], merged["timezone"]
    schedule.endpoint, schedule.model, schedule.source = merged["endpoint"], merged["model"], source
    schedule.prompt_template = merged["prompt_template"]
    schedule.index_prefix = normalize_prefix(merged["index_prefix"] or f"index/{schedule.id}/")
    schedule.completion_window, schedule.metadata_ = merged["completion_window"], merged["metadata"]
    # a new cron or timezone counts from now: no retroactive firing
    if "cron" in changes or "timezone" in changes:
        schedule.fire_after = max(schedule.fire_after, now)
    schedule.next_due_at = next_due_at(schedule.cron, schedule.timezone, schedule.fire_after)
    schedule.updated_at = now
    session.flush()
    return schedule


def pause_schedule(session: Session, schedule: Schedule, *, now: float) -> Schedule:
    schedule.status = ScheduleStatus.PAUSED
    schedule.updated_at = now
    session.flush()
    return schedule


def resume_schedule(session: Session, schedule: Schedule, *, now: float) -> Schedule:
    """Resume; due times that passed while paused do not fire."""
    if schedule.status != ScheduleStatus.ACTIVE:
        schedule.status = ScheduleStatus.ACTIVE
        schedule.fire_after = max(schedule.fire_after, now)
        schedule.next_due_at = next_due_at(schedule.cron, schedule.timezone, schedule.fire_after)
        schedule.updated_at = now
        session.flush()
    return schedule


def delete_schedule(session: Session, schedule: Schedule) -> None:
    session.delete(schedule)
    session.flush()


def get_schedule(session: Session, project_id: str, schedule_id: str) -> Schedule:
    schedule = session.get(Schedule, schedule_id)
    if schedule is None or schedule.project_id != project_id:
        raise ScheduleNotFound(schedule_id)
    return schedule


def list_schedules(session: Session, project_id: str, *, after: Optional[str] = None,
                   limit: int = 20) -> tuple[list[Schedule], bool]:
    """Newest first; `after` is the last id of the previous page. Returns (page, has_more)."""
    query = select(Schedule).where(Schedule.project_id == project_id)
    if after:
        anchor = get_schedule(session, project_id, after)
        query = query.where(or_(Schedule.created_at < anchor.created_at,
                                and_(Schedule.created_at == anchor.created_at, Schedule.id < anchor.id)))
    rows = session.scalars(query.order_by(Schedule.created_at.desc(), Schedule.id.desc())
                           .limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit


def list_runs(session: Session, schedule: Schedule, *, limit: int = 100) -> list[ScheduleRun]:
    return list(session.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule.id)
                                .order_by(ScheduleRun.due_at.desc()).limit(limit)))

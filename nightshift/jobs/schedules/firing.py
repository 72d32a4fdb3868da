"""Firing due schedules, exactly once per due time.

Firing is safe with two beat processes and across restarts, for two independent reasons:
  1. each schedule is fired in its own transaction holding its row lock
     (`SELECT … FOR UPDATE SKIP LOCKED` on Postgres; SQLite's `BEGIN IMMEDIATE` serializes
     writers), so a second firer skips it or sees it already advanced; the beat's tick
     (``nightshift.workers.schedule_runs``) gives each ``fire_schedule`` call its own transaction;
  2. the run row's unique key (schedule_id, due_at) is inserted with ON CONFLICT DO NOTHING:
     whoever inserts it owns the run, even a firer working from stale state.
Missed due times (service down) collapse into one run for the latest of them (``cron``).
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.ids import new_id
from nightshift.jobs.schedules.cron import due_time_to_fire, next_due_at, utc
from nightshift.jobs.schedules.models import RunStatus, Schedule, ScheduleRun, ScheduleStatus
from nightshift.jobs.schedules.runs import run_document
from nightshift.jobs.webhooks.events import record_event


def _insert_run_if_absent(session: Session, values: dict) -> bool:
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(ScheduleRun).values(**values).on_conflict_do_nothing(
        index_elements=["schedule_id", "due_at"]).returning(ScheduleRun.id)
    return session.execute(stmt).scalar() is not None


def fire_schedule(session: Session, schedule_id: str, now: float) -> Optional[str]:
    """Fire one schedule if a due time has come and nobody fired it; returns the new run's id.

    The run is PENDING (its batch is created by ``runs.start_run``), or SKIPPED when the
    schedule's previous run is still going. Commit right after: the row lock taken here is
    what keeps a second firer out.
    """
    schedule = session.scalars(
        select(Schedule).where(Schedule.id == schedule_id,
                               Schedule.status == ScheduleStatus.ACTIVE,
                               Schedule.next_due_at <= now)
        .with_for_update(skip_locked=True)).first()
    if schedule is None:
        return None   # not due, paused, or another firer holds its lock right now
    due = due_time_to_fire(schedule.cron, schedule.timezone,
                           fire_after=utc(schedule.fire_after), now=utc(now))
    if due is None:
        schedule.next_due_at = next_due_at(schedule.cron, schedule.timezone, schedule.fire_after)
        return None
    due_at = due.timestamp()
    busy = session.scalar(select(ScheduleRun.id).where(
        ScheduleRun.schedule_id == schedule.id, ScheduleRun.status.in_(RunStatus.ACTIVE)).limit(1))
    run_id = new_id("schedrun_")
    inserted = _insert_run_if_absent(session, {
        "id": run_id, "schedule_id": schedule.id, "due_at": due_at, "fired_at": now,
        "status": RunStatus.SKIPPED if busy else RunStatus.PENDING,
        "error": f"previous run {busy} was still active" if busy else None,
        "finished_at": now if busy else None,
        "documents_total": 0, "documents_selected": 0, "documents_indexed": 0,
        "documents_failed": 0, "documents_removed": 0,
    })
    schedule.fire_after = max(schedule.fire_after, due_at)
    schedule.next_due_at = next_due_at(schedule.cron, schedule.timezone, schedule.fire_after)
    return run_id if inserted and not busy else None


def due_schedule_ids(session: Session, now: float) -> list[str]:
    """Active schedules due at ``now``, the most overdue first (each to be fired in its own
    transaction)."""
    return list(session.scalars(
        select(Schedule.id).where(Schedule.status == ScheduleStatus.ACTIVE, Schedule.next_due_at <= now)
        .order_by(Schedule.next_due_at)))


def stale_pending_runs(session: Session, now: float, older_than: float) -> list[str]:
    """PENDING runs whose start message was probably lost (re-sent by the beat tick)."""
    return list(session.scalars(select(ScheduleRun.id).where(
        ScheduleRun.status == RunStatus.PENDING, ScheduleRun.fired_at <= now - older_than)))


def fail_runs_without_batch(session: Session, now: float) -> None:
    """A SUBMITTED run whose batch row was deleted would block its schedule forever: fail it
    (and tell the project's webhooks)."""
    orphans = session.scalars(select(ScheduleRun).where(ScheduleRun.status == RunStatus.SUBMITTED,
                                                        ScheduleRun.batch_id.is_(None)).with_for_update()).all()
    for run in orphans:
        run.status, run.error, run.finished_at = RunStatus.FAILED, "its batch was deleted", now
        session.flush()
        record_event(session, session.get(Schedule, run.schedule_id).project_id, "schedule_run.failed", run.id,
                     run_document(run), now)

"""The beat's schedules tick and a run's start, with their transactions (the rules are in
``nightshift.jobs.schedules``). The tasks send the start and ingest wake-ups once these
have committed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nightshift.jobs.schedules.firing import (due_schedule_ids, fail_runs_without_batch, fire_schedule,
                                              stale_pending_runs)
from nightshift.jobs.schedules.runs import finished_submitted_runs, publish_batch_results, start_run
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore


@dataclass
class TickResult:
    fired: list[str]        # new runs to start
    restart: list[str]      # runs still PENDING long after firing (start message lost)
    published: list[str]    # batches whose results were published by this tick


def fire_due_schedules(settings: Settings, now: float) -> list[str]:
    """Fire every active schedule that is due at `now`, each in its own transaction (its row
    lock is held only while it fires); returns the ids of new PENDING runs."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        due = due_schedule_ids(s, now)
    fired = []
    for schedule_id in due:
        with session_scope(url) as s:
            run_id = fire_schedule(s, schedule_id, now)
        if run_id:
            fired.append(run_id)
    return fired


def schedule_tick(settings: Settings, store: ObjectStore, *, now: float) -> TickResult:
    """One beat tick: fire due schedules, find runs whose start was lost, and publish the
    results of finished scheduled batches that finalize did not publish (safety net)."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        fail_runs_without_batch(s, now)
    fired = fire_due_schedules(settings, now)
    with session_scope(url) as s:
        stale = stale_pending_runs(s, now, settings.schedule_start_retry_seconds)
        finished = finished_submitted_runs(s)
    published = [batch_id for batch_id in finished if complete_batch_run(settings, store, batch_id, now=now)]
    return TickResult(fired, [r for r in stale if r not in fired], published)


def complete_batch_run(settings: Settings, store: ObjectStore, batch_id: str, *,
                       now: Optional[float] = None) -> bool:
    """Once a batch has ended (after finalize, or found by the tick): publish its results to the
    schedule run that created it, if that run is still waiting. True if it published."""
    with session_scope(settings.resolved_database_url) as s:
        return publish_batch_results(s, store, batch_id, now=now)


def start_schedule_run(settings: Settings, store: ObjectStore, run_id: str, *,
                       now: Optional[float] = None) -> Optional[str]:
    """Start a fired run in one transaction; the id of the batch it created, if any."""
    with session_scope(settings.resolved_database_url) as s:
        return start_run(s, store, settings, run_id, now=now)

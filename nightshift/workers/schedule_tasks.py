"""Celery tasks of schedules (issue 6): the beat tick and the start of a fired run.

The tick runs on every beat (and may run on two beats at once): firing is exactly-once in
the database (jobs/schedules.py), so a duplicate tick finds nothing to do. Messages are
sent only after the commits that make their work visible.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from nightshift.jobs.schedule_runs import schedule_tick, start_run
from nightshift.storage.db import get_sessionmaker
from nightshift.storage.objectstore import get_object_store
from nightshift.workers import dispatch
from nightshift.workers.celery_app import TASK_SCHEDULE_START_RUN, TASK_SCHEDULES_TICK, app

log = logging.getLogger(__name__)


def enqueue_start_run(run_id: str) -> None:
    app.send_task(TASK_SCHEDULE_START_RUN, args=[run_id], queue="cpu")


@app.task(name=TASK_SCHEDULES_TICK)
def schedules_tick(now: Optional[float] = None) -> dict:
    """`now` is only for tests (a controllable clock); beat sends no argument."""
    result = schedule_tick(get_sessionmaker(), get_object_store(),
                           now=time.time() if now is None else now)
    for run_id in result.fired + result.restart:
        enqueue_start_run(run_id)
    if result.fired or result.restart or result.published:
        log.info("schedules tick: %s", result)
    return {"fired": result.fired, "restart": result.restart, "published": result.published}


@app.task(name=TASK_SCHEDULE_START_RUN)
def start_schedule_run(run_id: str, now: Optional[float] = None) -> Optional[str]:
    batch_id = start_run(get_sessionmaker(), get_object_store(), run_id,
                         now=time.time() if now is None else now)
    if batch_id:
        dispatch.enqueue_ingest(batch_id)
    return batch_id

"""Celery tasks of schedules: the beat tick and the start of a fired run.

The tick runs on every beat (and may run on two beats at once): firing is exactly-once in
the database (``nightshift.jobs.schedules.firing``), so a duplicate tick finds nothing to
do. Messages are sent only after the commits that make their work visible.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from nightshift.settings import get_settings
from nightshift.storage.objectstore import get_object_store
from nightshift.workers import dispatch
from nightshift.workers.celery_app import TASK_SCHEDULE_START_RUN, TASK_SCHEDULES_TICK, app
from nightshift.workers.schedule_runs import schedule_tick, start_schedule_run

log = logging.getLogger(__name__)


@app.task(name=TASK_SCHEDULES_TICK)
def schedules_tick(now: Optional[float] = None) -> dict:
    """`now` is only for tests (a controllable clock); beat sends no argument."""
    settings = get_settings()
    result = schedule_tick(settings, get_object_store(settings), now=time.time() if now is None else now)
    for run_id in result.fired + result.restart:
        dispatch.enqueue_start_run(run_id)
    if result.fired or result.restart or result.published:
        log.info("schedules tick: %s", result)
    return {"fired": result.fired, "restart": result.restart, "published": result.published}


@app.task(name=TASK_SCHEDULE_START_RUN)
def start_run(run_id: str, now: Optional[float] = None) -> Optional[str]:
    settings = get_settings()
    batch_id = start_schedule_run(settings, get_object_store(settings), run_id,
                                  now=time.time() if now is None else now)
    if batch_id:
        dispatch.enqueue_ingest(batch_id)
    return batch_id

"""Schedules on real Postgres (and SQLite): due times with a fake clock, catch-up once,
no double fire with concurrent firers or a stale firer, pause/resume, tenancy."""
from __future__ import annotations

import threading
from datetime import datetime, timezone

import pytest
from sqlalchemy import func, select

from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import Project
from nightshift.jobs.schedules.cron import InvalidScheduleError
from nightshift.jobs.schedules.firing import fire_schedule
from nightshift.jobs.schedules.models import RunStatus, Schedule, ScheduleRun
from nightshift.jobs.schedules.service import (ScheduleConflict, ScheduleNotFound, create_schedule, get_schedule,
                                               list_runs, list_schedules, pause_schedule, resume_schedule,
                                               update_schedule)
from nightshift.settings import Settings
from nightshift.storage.db import get_sessionmaker
from nightshift.workers.schedule_runs import fire_due_schedules
from tests.service.factories import in_transaction


def ts(*args) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


TEMPLATE = {"messages": [{"role": "user", "content": "Summarize:\n{{ document }}"}], "max_tokens": 8}


def make_project(sm) -> str:
    with sm() as s, s.begin():
        pid = new_id("proj_")
        s.add(Project(id=pid, name=pid))
    return pid


def make_schedule(sm, project_id, *, now, cron="0 2 * * *", tz="UTC", name="nightly") -> str:
    with sm() as s, s.begin():
        sched = create_schedule(s, project_id=project_id, name=name, cron=cron, timezone_name=tz,
                                endpoint="/v1/chat/completions", model="default",
                                source={"type": "prefix", "prefix": "docs"},
                                prompt_template=TEMPLATE, now=now)
        return sched.id


def runs(sm, schedule_id) -> list[ScheduleRun]:
    with sm() as s:
        return list(s.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule_id)
                              .order_by(ScheduleRun.due_at)))


def finish_runs(sm, schedule_id):
    with sm() as s, s.begin():
        for run in s.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule_id)):
            if run.status == RunStatus.PENDING:
                run.status = RunStatus.SUCCEEDED


def test_fires_at_due_time_once_and_catches_up_once(any_db):
    sm = get_sessionmaker(any_db)
    settings = Settings(database_url=any_db)
    pid = make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 22, 0))
    assert fire_due_schedules(settings, ts(2026, 11, 21, 1, 59, 59)) == []
    fired = fire_due_schedules(settings, ts(2026, 11, 21, 2, 0))
    assert len(fired) == 1
    assert fire_due_schedules(settings, ts(2026, 11, 21, 2, 0, 30)) == []
    [run] = runs(sm, sid)
    assert (run.id, run.due_at, run.status) == (fired[0], ts(2026, 11, 21, 2, 0), RunStatus.PENDING)
    finish_runs(sm, sid)
    # down for four nights: one catch-up run for the latest missed due time only
    fired = fire_due_schedules(settings, ts(2026, 11, 25, 9, 30))
    assert len(fired) == 1
    assert fire_due_schedules(settings, ts(2026, 11, 25, 9, 31)) == []
    assert [r.due_at for r in runs(sm, sid)] == [ts(2026, 11, 21, 2), ts(2026, 11, 25, 2)]
    with sm() as s:
        assert s.get(Schedule, sid).next_due_at == ts(2026, 11, 26, 2)


def test_timezone_due_time(pg_db):
    sm = get_sessionmaker(pg_db)
    settings = Settings(database_url=pg_db)
    pid = make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 12), tz="Europe/Berlin")
    with sm() as s:
        assert s.get(Schedule, sid).next_due_at == ts(2026, 11, 21, 1)   # 02:00 CET
    assert fire_due_schedules(settings, ts(2026, 11, 21, 0, 59)) == []
    assert len(fire_due_schedules(settings, ts(2026, 11, 21, 1, 0))) == 1


def test_concurrent_firers_fire_each_due_time_exactly_once(any_db):
    sm = get_sessionmaker(any_db)
    settings = Settings(database_url=any_db)
    pid = make_project(sm)
    ids = [make_schedule(sm, pid, now=ts(2026, 11, 20, 12), name=f"s{i}", cron="*/5 * * * *")
           for i in range(8)]
    now = ts(2026, 11, 20, 12, 5)
    barrier = threading.Barrier(4)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def firer():
        try:
            barrier.wait()
            results.append(fire_due_schedules(settings, now))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=firer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    fired = [run_id for chunk in results for run_id in chunk]
    assert len(fired) == len(set(fired)) == 8
    with sm() as s:
        counts = dict(s.execute(select(ScheduleRun.schedule_id, func.count())
                                .group_by(ScheduleRun.schedule_id)).all())
    assert counts == {sid: 1 for sid in ids}


def test_stale_firer_is_stopped_by_the_unique_run_key(pg_db):
    """A second beat working from state read before the first one fired (or a restart that
    lost its bookkeeping) cannot create a second run for the same due time."""
    sm = get_sessionmaker(pg_db)
    pid = make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 22))
    due_now = ts(2026, 11, 21, 2, 0, 10)
    assert in_transaction(pg_db, fire_schedule, sid, due_now)
    finish_runs(sm, sid)
    with sm() as s, s.begin():   # rewind the schedule as a stale process would see it
        sched = s.get(Schedule, sid)
        sched.fire_after, sched.next_due_at = ts(2026, 11, 20, 22), ts(2026, 11, 21, 2)
    assert in_transaction(pg_db, fire_schedule, sid, due_now) is None
    assert len(runs(sm, sid)) == 1


def test_overlapping_run_is_skipped_not_doubled(pg_db):
    sm = get_sessionmaker(pg_db)
    settings = Settings(database_url=pg_db)
    pid = make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 12), cron="0 * * * *")
    assert len(fire_due_schedules(settings, ts(2026, 11, 20, 13))) == 1
    assert fire_due_schedules(settings, ts(2026, 11, 20, 14)) == []   # first run still pending
    assert [r.status for r in runs(sm, sid)] == [RunStatus.PENDING, RunStatus.SKIPPED]


def test_pause_resume_does_not_fire_missed_times(pg_db):
    sm = get_sessionmaker(pg_db)
    settings = Settings(database_url=pg_db)
    pid = make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 12))
    with sm() as s, s.begin():
        pause_schedule(s, get_schedule(s, pid, sid), now=ts(2026, 11, 20, 13))
    assert fire_due_schedules(settings, ts(2026, 11, 21, 3)) == []
    with sm() as s, s.begin():
        resume_schedule(s, get_schedule(s, pid, sid), now=ts(2026, 11, 21, 3))
    assert fire_due_schedules(settings, ts(2026, 11, 21, 4)) == []
    assert len(fire_due_schedules(settings, ts(2026, 11, 22, 2))) == 1


def test_validation_conflict_update_and_tenancy(pg_db):
    sm = get_sessionmaker(pg_db)
    pid, other = make_project(sm), make_project(sm)
    sid = make_schedule(sm, pid, now=ts(2026, 11, 20, 12))
    with sm() as s:
        with pytest.raises(InvalidScheduleError) as info:
            create_schedule(s, project_id=pid, name="x", cron="0 25 * * *", endpoint="/v1/chat/completions",
                            model="default", source={"type": "prefix", "prefix": "d"},
                            prompt_template=TEMPLATE, now=0)
        assert info.value.param == "cron"
        with pytest.raises(InvalidScheduleError) as info:
            create_schedule(s, project_id=pid, name="x", cron="0 2 * * *", endpoint="/v1/chat/completions",
                            model="default", source={"type": "file", "file_id": "file-nope"}, now=0)
        assert info.value.param == "source.file_id"
        with pytest.raises(InvalidScheduleError) as info:
            create_schedule(s, project_id=pid, name="x", cron="0 2 * * *", endpoint="/v1/chat/completions",
                            model="default", source={"type": "prefix", "prefix": "d"},
                            prompt_template={"messages": "{{ document"}, now=0)
        assert info.value.param == "prompt_template"
        with pytest.raises(ScheduleConflict):
            create_schedule(s, project_id=pid, name="nightly", cron="0 2 * * *",
                            endpoint="/v1/chat/completions", model="default",
                            source={"type": "prefix", "prefix": "d"}, prompt_template=TEMPLATE, now=0)
        with pytest.raises(ScheduleNotFound):
            get_schedule(s, other, sid)
        assert list_schedules(s, other) == ([], False)
    with sm() as s, s.begin():
        sched = update_schedule(s, get_schedule(s, pid, sid), {"cron": "30 3 * * *"},
                                now=ts(2026, 11, 20, 12, 30))
        assert sched.next_due_at == ts(2026, 11, 21, 3, 30)
    with sm() as s:
        page, more = list_schedules(s, pid, limit=1)
        assert [p.id for p in page] == [sid] and more is False
        assert list_runs(s, get_schedule(s, pid, sid)) == []

"""api/database.py in-process, on SQLite: bounded concurrency, a bounded wait that ends in
Overloaded, and slots that come back whatever the work does."""
from __future__ import annotations

import threading
import time

import anyio
import pytest
from sqlalchemy import text

from nightshift.api.database import Overloaded, RequestDatabase


def _database(settings_env, sqlite_db, **values) -> RequestDatabase:
    return RequestDatabase(settings_env(database_url=sqlite_db, **values))


def test_work_beyond_the_slots_waits_then_is_refused(settings_env, sqlite_db):
    database = _database(settings_env, sqlite_db, db_pool_size=2, api_queue_seconds=0.2)
    release = threading.Event()
    running = []

    def hold(session):  # noqa: ANN001, ANN202
        session.execute(text("SELECT 1"))
        running.append(1)
        release.wait(5)
        return "held"

    async def main():  # noqa: ANN202
        outcomes = []

        async def call(work):  # noqa: ANN001, ANN202
            try:
                outcomes.append(await database.run(work, read_only=True))
            except Overloaded as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, hold)
            tg.start_soon(call, hold)
            await anyio.sleep(0.1)
            assert database.busy == 2
            started = time.monotonic()
            await call(hold)                     # no slot within 0.2 s: refused, not queued forever
            assert isinstance(outcomes[-1], Overloaded) and outcomes[-1].retry_after_seconds == 1
            assert 0.15 < time.monotonic() - started < 1.5
            release.set()
        assert database.busy == 0
        assert await database.run(lambda s: s.execute(text("SELECT 2")).scalar()) == 2
        return outcomes

    outcomes = anyio.run(main)
    assert sorted(map(str, outcomes)) == sorted(["held", "held", str(Overloaded(1))])
    assert len(running) == 2


def test_failed_work_rolls_back_and_frees_its_slot(settings_env, sqlite_db):
    database = _database(settings_env, sqlite_db, db_pool_size=1, api_queue_seconds=0.5)

    def write_then_fail(session):  # noqa: ANN001, ANN202
        session.execute(text("INSERT INTO projects (id, name, created_at) VALUES ('proj_x', 'x', 0)"))
        raise RuntimeError("boom")

    async def main():  # noqa: ANN202
        for _ in range(3):                       # a leaked slot would make the 2nd call wait, then fail
            with pytest.raises(RuntimeError):
                await database.run(write_then_fail)
        return await database.run(lambda s: s.execute(text("SELECT count(*) FROM projects")).scalar(),
                                  read_only=True)

    assert anyio.run(main) == 0
    assert database.busy == 0

"""api/database.py in-process, on SQLite: bounded concurrency, a bounded wait that ends in
Overloaded, and slots that come back whatever the work does."""
from __future__ import annotations

import threading
import time

import anyio
import pytest
from sqlalchemy import NullPool, create_engine, text
from sqlalchemy.exc import ProgrammingError

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


def _close_other_connections(url: str) -> int:
    """What a database restart does to a pool: every other session of the database is ended."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return len(conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                         "WHERE datname = current_database() AND pid <> pg_backend_pid()")).all())
    finally:
        engine.dispose()


def test_connections_closed_by_a_database_restart_cost_no_request(settings_env, pg_db):
    database = RequestDatabase(settings_env(database_url=pg_db, db_pool_size=2))
    count = "SELECT count(*) FROM projects"

    def add(name):  # noqa: ANN001, ANN202
        def write(session):  # noqa: ANN001, ANN202
            session.execute(text("INSERT INTO projects (id, name, created_at) VALUES (:id, :id, 0)"), {"id": name})
            return session.execute(text(count)).scalar()
        return write

    async def main():  # noqa: ANN202
        try:
            assert await database.run(add("proj_a")) == 1
            both = [database.run(lambda s: s.execute(text(count)).scalar(), read_only=True) for _ in range(2)]
            assert [await call for call in both] == [1, 1]
            assert _close_other_connections(pg_db) >= 1     # the pool's connections among them
            # the first statement on a closed connection fails before anything is written: the
            # work runs again on a new connection, once, and the caller sees only the answer
            assert await database.run(lambda s: s.execute(text(count)).scalar(), read_only=True) == 1
            _close_other_connections(pg_db)
            assert await database.run(add("proj_b")) == 2
            return await database.run(lambda s: s.execute(text("SELECT id FROM projects ORDER BY id")).scalars().all(),
                                      read_only=True)
        finally:
            database.close()

    assert anyio.run(main) == ["proj_a", "proj_b"]                 # each write exactly once


def test_other_database_errors_are_not_run_again(settings_env, pg_db):
    database = RequestDatabase(settings_env(database_url=pg_db, db_pool_size=1))
    calls = []

    def bad(session):  # noqa: ANN001, ANN202
        calls.append(1)
        session.execute(text("SELECT * FROM no_such_table"))

    async def main():  # noqa: ANN202
        try:
            with pytest.raises(ProgrammingError):
                await database.run(bad, read_only=True)
            with pytest.raises(ProgrammingError):
                await database.run(bad)
        finally:
            database.close()

    anyio.run(main)
    assert len(calls) == 2


def test_reads_run_without_a_transaction_on_postgres(settings_env, pg_db):
    database = RequestDatabase(settings_env(database_url=pg_db, db_pool_size=1))

    def autocommit(session):  # noqa: ANN001, ANN202
        return session.connection().connection.driver_connection.autocommit

    async def main():  # noqa: ANN202
        try:
            return await database.run(autocommit, read_only=True), await database.run(autocommit)
        finally:
            database.close()

    # no BEGIN/ROLLBACK round trips around a poll; a write is still one transaction
    assert anyio.run(main) == (True, False)

"""SQLAlchemy engine and session factories for Postgres and SQLite, and `alembic upgrade head`.

SQLite (the embedded default) gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` for every
transaction: writers queue on the busy timeout instead of failing a lock upgrade, which is
SQLite's stand-in for Postgres row locks (Prefect does the same).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

_lock = threading.Lock()
_engines: dict[tuple[str, int], Engine] = {}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # let the "begin" hook below open transactions
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # noqa: ANN001
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def get_engine(url: Optional[str] = None) -> Engine:
    """One engine per (url, process): pools must not cross a fork."""
    if url is None:
        from jobs.settings import get_settings

        url = get_settings().resolved_database_url
    key = (url, os.getpid())
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = make_engine(url)
        return engine


def get_sessionmaker(url: Optional[str] = None) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: Optional[str] = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on an exception."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def dispose_engines() -> None:
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def alembic_config(url: str):
    """An Alembic config for the packaged migrations (no alembic.ini needed)."""
    from alembic.config import Config

    import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade_head(url: Optional[str] = None) -> None:
    """Bring the database to the newest schema (`alembic upgrade head`)."""
    from alembic import command

    if url is None:
        from jobs.settings import get_settings

        url = get_settings().resolved_database_url
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), "head")

"""SQLAlchemy engine and session factories for Postgres and SQLite, and `alembic upgrade head`.

SQLite (the embedded default) gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` for every
transaction: writers queue on the busy timeout instead of failing a lock upgrade, which is
SQLite's stand-in for Postgres row locks (Prefect does the same). Read-only sessions
(``read_only_session_scope``) begin deferred instead: under WAL they read a snapshot without
waiting for a writer.

Every process has one pool per URL of ``db_pool_size`` connections and no overflow: the API
admits that many units of work at once (api/database.py), and workers use a few threads.
"""
from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

_lock = threading.Lock()
_engines: dict[tuple[str, int], Engine] = {}


READ_ONLY = "nightshift_read_only"   # execution option: SQLite begins deferred
# JSON columns (request bodies, prompt token ids, response bodies) through orjson: several times
# faster than the json module, and these columns are read and written per request.
JSON_CODEC = {"json_serializer": lambda value: orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode(),
              "json_deserializer": orjson.loads}


def make_engine(url: str, pool_size: int = 8, pool_timeout: float = 10.0, pre_ping: bool = True,
                connect_timeout: Optional[float] = None) -> Engine:
    """An engine with a pool of ``pool_size`` connections and no overflow. ``pre_ping`` (Postgres):
    each checkout first tests its connection with a round trip, so that one closed by a server
    restart is replaced before use; the API turns it off and runs its work again instead when a
    connection is found closed (api/database.py). ``connect_timeout`` (Postgres, seconds; libpq
    takes whole seconds, at least 2): opening a connection gives up after that long, and so does
    a connection whose sent data the server has not acknowledged for that long (libpq's
    ``tcp_user_timeout``: a host gone from the network), instead of waiting for TCP to give up
    (minutes); None: libpq's defaults (no limit)."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False},
                               pool_size=pool_size, max_overflow=0, pool_timeout=pool_timeout, **JSON_CODEC)

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
            read_only = conn.get_execution_options().get(READ_ONLY, False)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine
    connect_args = {}
    if connect_timeout:
        connect_args = {"connect_timeout": max(2, math.ceil(connect_timeout)),
                        "tcp_user_timeout": max(1000, round(connect_timeout * 1000))}
    return create_engine(url, pool_pre_ping=pre_ping, pool_size=pool_size, max_overflow=0, pool_timeout=pool_timeout,
                         connect_args=connect_args, **JSON_CODEC)


def get_engine(url: Optional[str] = None) -> Engine:
    """One engine per (url, process): pools must not cross a fork."""
    from nightshift.settings import get_settings

    settings = get_settings()
    url = url or settings.resolved_database_url
    key = (url, os.getpid())
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = make_engine(url, settings.db_pool_size, settings.db_pool_timeout_seconds)
        return engine


def get_sessionmaker(url: Optional[str] = None) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: Optional[str] = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on an exception: one transaction. Only
    the owners of a unit of work open one (an API request, a Celery task's step in workers/,
    the CLI, a test); the domain functions of jobs/ take the session and never commit."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@contextmanager
def read_only_session_scope(url: Optional[str] = None) -> Iterator[Session]:
    """A session for reads only: on SQLite it does not take the write lock; it never commits.
    Closing (not rolling back) keeps what was loaded readable after the session ends."""
    session = Session(bind=get_engine(url).execution_options(**{READ_ONLY: True}), expire_on_commit=False)
    try:
        yield session
    finally:
        session.close()


def dispose_engines() -> None:
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()

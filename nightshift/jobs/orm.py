"""The declarative base every table shares, and the column conventions that go with it.

Times are Unix seconds (float) everywhere: the API speaks Unix seconds and the same column
works on Postgres and SQLite. Schema changes go through a new Alembic revision in
migrations/versions/; ``nightshift.jobs.tables`` gathers every table for Alembic.
"""
from __future__ import annotations

import time

from sqlalchemy import BigInteger, Integer, MetaData
from sqlalchemy.orm import DeclarativeBase

# Alembic's revisions name constraints by these patterns; the models must produce the same names.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT primary keys autoincrement on Postgres; SQLite only autoincrements "INTEGER PRIMARY KEY".
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)

"""`nightshift migrate` says what it did: created the schema on a fresh database, upgraded an
older one from its revision, or found it already at the newest (SQLite and Postgres)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from alembic import command

from nightshift.migrations import alembic_config, current_revision, head_revision

from .api_fixtures import REPO, service_env
from .conftest import PG_ADMIN_URL, _admin_engine


def migrate(tmp_path, url: str) -> str:  # noqa: ANN001
    env = service_env(tmp_path / "home", database_url=url)
    done = subprocess.run([sys.executable, "-m", "nightshift.api.cli", "migrate"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    name = f"nightshift_migrate_{tmp_path.name[-20:].lower().replace('-', '_')}"
    admin = _admin_engine()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_migrate_reports_created_then_already_newest(fresh_url, tmp_path):
    head = head_revision()
    assert current_revision(fresh_url) is None
    assert migrate(tmp_path, fresh_url) == f"created the schema at revision {head} (the newest)"
    assert current_revision(fresh_url) == head
    assert migrate(tmp_path, fresh_url) == f"already at the newest revision {head}"


def test_migrate_reports_the_upgrade_from_an_older_revision(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    command.upgrade(alembic_config(url), "0002")
    assert migrate(tmp_path, url) == f"upgraded the schema from revision 0002 to {head_revision()} (the newest)"

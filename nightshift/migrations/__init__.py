"""Alembic environment and revisions. `upgrade_head(url)` brings a database to the newest schema
(`nightshift migrate`, `nightshift serve` and the tests call it; `alembic upgrade head` with the
repository's alembic.ini does the same) and says what it did."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Migration:
    """The schema revision of a database before and after an upgrade (None: no schema)."""

    before: Optional[str]
    after: Optional[str]

    def describe(self) -> str:
        if self.before is None:
            return f"created the schema at revision {self.after} (the newest)"
        if self.before != self.after:
            return f"upgraded the schema from revision {self.before} to {self.after} (the newest)"
        return f"already at the newest revision {self.after}"


def alembic_config(url: str):  # noqa: ANN201
    """An Alembic config for these migrations (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["database_url"] = url
    return cfg


def current_revision(url: str) -> Optional[str]:
    """The database's schema revision (Alembic's ``alembic_version``), None if it has none."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine, pool

    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest revision these migrations define."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def upgrade_head(url: Optional[str] = None) -> Migration:
    """Bring the database to the newest schema (`alembic upgrade head`); returns the revisions
    before and after."""
    from alembic import command

    if url is None:
        from nightshift.settings import get_settings

        url = get_settings().resolved_database_url
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    before = current_revision(url)
    command.upgrade(alembic_config(url), "head")
    return Migration(before, current_revision(url))

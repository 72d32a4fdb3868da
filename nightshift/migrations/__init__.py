"""Alembic environment and revisions. `upgrade_head(url)` brings a database to the newest schema
(`nightshift migrate`, `nightshift serve` and the tests call it; `alembic upgrade head` with the
repository's alembic.ini does the same)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def alembic_config(url: str):  # noqa: ANN201
    """An Alembic config for these migrations (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["database_url"] = url
    return cfg


def upgrade_head(url: Optional[str] = None) -> None:
    """Bring the database to the newest schema (`alembic upgrade head`)."""
    from alembic import command

    if url is None:
        from nightshift.settings import get_settings

        url = get_settings().resolved_database_url
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), "head")

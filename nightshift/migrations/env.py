"""Alembic environment: URL from the caller (nightshift.migrations.alembic_config) or from settings."""
from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from nightshift.jobs.tables import metadata
from nightshift.storage.db import make_engine

config = context.config
target_metadata = metadata


def _url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        from nightshift.settings import get_settings

        url = get_settings().resolved_database_url
    return url


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"), compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    connectable = make_engine(url)
    if not url.startswith("sqlite"):
        from sqlalchemy import create_engine

        connectable = create_engine(url, poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    connectable.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

"""The migrations (run by the pg_url/sqlite_db fixtures) build exactly the schema the models
declare: no table, column, index or constraint missing on either side."""
from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from nightshift.jobs.tables import metadata
from nightshift.storage.db import get_engine


@pytest.mark.parametrize("db", ["pg_url", "sqlite_db"])
def test_no_drift_between_models_and_migrations(db, request):
    url = request.getfixturevalue(db)
    with get_engine(url).connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(context, metadata)
    assert diff == []

"""Alembic environment and revisions (run through storage.db.upgrade_head or `alembic upgrade head`)."""

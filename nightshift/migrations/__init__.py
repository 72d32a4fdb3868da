"""Alembic environment and revisions (run through nightshift.storage.db.upgrade_head or `alembic upgrade head`)."""

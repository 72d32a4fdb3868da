"""Every table of the service on one metadata: Alembic's target (migrations/env.py) and what
the schema test compares the migrations with. Importing the model modules registers their
tables; a new concept's models are added here."""
from __future__ import annotations

import nightshift.jobs.batches.models  # noqa: F401
import nightshift.jobs.engine_hosts.models  # noqa: F401
import nightshift.jobs.files.models  # noqa: F401
import nightshift.jobs.projects.models  # noqa: F401
import nightshift.jobs.schedules.models  # noqa: F401
import nightshift.jobs.webhooks.models  # noqa: F401
from nightshift.jobs.orm import Base

metadata = Base.metadata

"""What finalize does for issue 6, in finalize's own transaction once the batch is terminal:
write the cost report files and publish a scheduled run's results. Both are idempotent, so a
finalize that is retried after a crash writes the same objects again and counts nothing twice.
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy.orm import Session

from nightshift.jobs.cost_reports import write_cost_files
from nightshift.jobs.models import Batch
from nightshift.jobs.schedule_runs import publish_batch_results
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore


def after_finalize(session: Session, store: ObjectStore, batch: Batch, *, now: float,
                   settings: Optional[Settings] = None) -> None:
    write_cost_files(session, store, batch, settings=settings, now=now)
    publish_batch_results(session, store, batch.id, now=now)

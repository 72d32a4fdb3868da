"""Expired files: uploads past their ``expires_at`` (OpenAI's 30 days for ``purpose=batch``, or
the upload's ``expires_after``) are removed from the object store and their rows marked
deleted (``deleted_at``; the row stays, as batches refer to it). Kept while still needed: the
input file of a batch that has not ended, and the source file of a schedule. A batch cannot be
created on a file that has expired (``files.service.check_not_expired``), so once a file is
found expired and unused nothing new comes to need it. The upkeep flow that runs this is
``nightshift.workers.file_expiry``."""
from __future__ import annotations

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus
from nightshift.jobs.files.models import File
from nightshift.jobs.schedules.models import Schedule


def schedule_source_files(session: Session) -> set[str]:
    """Ids of the files schedules read their documents from (kept however old)."""
    return {source["file_id"] for source in session.scalars(select(Schedule.source))
            if isinstance(source, dict) and source.get("type") == "file" and isinstance(source.get("file_id"), str)}


def expired_files(session: Session, now: float, limit: int) -> list[tuple[str, str]]:
    """Up to ``limit`` (file id, object key) of files past their expiry, not yet deleted, and
    needed by no unfinished batch and no schedule; the longest expired first."""
    in_use = exists().where(Batch.input_file_id == File.id, Batch.status.not_in(BatchStatus.TERMINAL))
    query = select(File.id, File.object_key).where(File.expires_at <= now, File.deleted_at.is_(None), ~in_use)
    kept = schedule_source_files(session)
    if kept:
        query = query.where(File.id.not_in(kept))
    return [(file_id, key) for file_id, key in session.execute(query.order_by(File.expires_at, File.id).limit(limit))]


def mark_files_deleted(session: Session, file_ids: list[str], now: float) -> int:
    """Mark the rows deleted (those not already); returns how many were marked."""
    if not file_ids:
        return 0
    res = session.execute(update(File).where(File.id.in_(file_ids), File.deleted_at.is_(None))
                          .values(deleted_at=now))
    return res.rowcount

"""Retry only the failed lines of an ended batch.

The requests in a batch's error file (rejected by the model: a 400 response; or never run:
``batch_cancelled``, ``batch_expired``, ``shard_failed``) become the lines of a new input file,
each with its original ``custom_id`` and body, and a new batch runs them. Optionally only the
lines with given error codes are taken. The two batches are linked in their metadata:
``retry_of`` on the new one, ``retried_by`` (the newest retry) on the original. The
original's requests, files and counts are left as they were.

Two steps, so that no database connection is held while the file is stored:
``failed_lines`` (read) -> ``store_upload`` (object store) -> ``create_retry_batch`` (write).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.anthropic_batches import create_message_batch
from nightshift.jobs.batches.anthropic_messages import MESSAGES
from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus
from nightshift.jobs.batches.service import create_batch, get_batch
from nightshift.jobs.errors import Conflict
from nightshift.jobs.files.uploads import StoredUpload, record_file
from nightshift.settings import Settings

ENDED = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


@dataclass(frozen=True)
class FailedLines:
    """The JSONL of an ended batch's failed requests, ready to be stored as a new input file."""

    batch_id: str
    endpoint: str
    completion_window: str
    output_expires_after_seconds: Optional[int]
    jsonl: bytes
    count: int


def error_code_of(row: Request) -> Optional[str]:
    """The code the request's error-file line carries: the model's error body's code (a 400
    response) or the code of a request that never ran."""
    body = row.response_body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("code") or row.error_code
    return row.error_code


def failed_lines(session: Session, project_id: str, batch_id: str,
                 error_codes: Optional[Sequence[str]] = None) -> FailedLines:
    """The failed requests of an ended batch as input lines, in their original order (only those
    whose error code is in ``error_codes``, when given)."""
    batch = get_batch(session, project_id, batch_id)
    if batch.status not in ENDED:
        raise Conflict(f"Batch '{batch_id}' is {batch.status}: only an ended batch (completed, failed, expired or "
                       "cancelled) can be retried.", "batch_not_ended")
    wanted = set(error_codes) if error_codes else None
    lines: list[bytes] = []
    rows = session.scalars(select(Request).where(Request.batch_id == batch_id, Request.status == RequestStatus.FAILED)
                           .order_by(Request.line))
    for row in rows:
        if wanted is not None and error_code_of(row) not in wanted:
            continue
        lines.append(orjson.dumps({"custom_id": row.custom_id, "method": "POST", "url": batch.endpoint,
                                   "body": row.body}) + b"\n")
    if not lines:
        which = f" with error code {', '.join(sorted(wanted))}" if wanted else ""
        why = " (its input file failed validation: fix the file and create a new batch)" \
            if batch.status == BatchStatus.FAILED and not batch.request_total else ""
        raise Conflict(f"Batch '{batch_id}' has no failed requests{which} to retry{why}.", "nothing_to_retry")
    return FailedLines(batch.id, batch.endpoint, batch.completion_window, batch.output_expires_after_seconds,
                       b"".join(lines), len(lines))


def create_retry_batch(session: Session, settings: Settings, *, project_id: str, source: FailedLines,
                       upload: StoredUpload, metadata: Optional[dict[str, str]] = None) -> Batch:
    """Record the stored retry file and create its batch (status ``validating``; the caller
    commits, then sends the ingest wake-up), and link both batches."""
    meta = {**(metadata or {}), "retry_of": source.batch_id}
    file = record_file(session, project_id, upload)
    if source.endpoint == MESSAGES:     # a message batch's retry is a message batch too
        batch = create_message_batch(session, settings, project_id=project_id, input_file_id=file.id,
                                     requests=source.count)
        batch.metadata_ = meta
    else:
        batch = create_batch(session, settings, project_id=project_id, input_file_id=file.id,
                             endpoint=source.endpoint, completion_window=source.completion_window, metadata=meta,
                             output_expires_after_seconds=source.output_expires_after_seconds)
    original = get_batch(session, project_id, source.batch_id)
    original.metadata_ = {**(original.metadata_ or {}), "retried_by": batch.id}
    return batch

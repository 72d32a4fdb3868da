"""What the API asks of batches: create (status validating; the caller commits, then sends
the ingest wake-up), get and list within a project, and cancel requests. The transitions
themselves are in ``nightshift.jobs.batches.lifecycle``."""
from __future__ import annotations

import time
from typing import Optional, Sequence

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from nightshift.jobs.batches.lifecycle import InvalidTransition, request_cancel
from nightshift.jobs.batches.models import Batch, BatchStatus
from nightshift.jobs.batches.openai_mapping import ENDPOINTS
from nightshift.jobs.errors import Conflict, InvalidInput, NotFound
from nightshift.jobs.files.service import check_not_expired, get_file
from nightshift.jobs.ids import new_id
from nightshift.settings import Settings

COMPLETION_WINDOWS = ("24h",)   # its length is settings.completion_window_seconds


def create_batch(session: Session, settings: Settings, *, project_id: str, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: Optional[dict[str, str]] = None,
                 output_expires_after_seconds: Optional[int] = None) -> Batch:
    if endpoint not in ENDPOINTS:
        raise InvalidInput(f"Invalid value: '{endpoint}'. Supported values are: "
                           + ", ".join(f"'{e}'" for e in ENDPOINTS) + ".", "endpoint", "invalid_value")
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidInput(f"Invalid value: '{completion_window}'. Supported values are: '24h'.",
                           "completion_window", "invalid_value")
    _check_metadata(metadata)
    source = get_file(session, project_id, input_file_id, "input_file_id")
    if source.purpose != "batch":
        raise InvalidInput(f"File '{input_file_id}' has purpose '{source.purpose}'; a batch needs a file "
                           "uploaded with purpose 'batch'.", "input_file_id", "invalid_value")
    created = time.time()
    check_not_expired(source, "input_file_id", created)   # an expired file is about to be removed
    batch = Batch(id=new_id("batch_"), project_id=project_id, input_file_id=input_file_id, endpoint=endpoint,
                  completion_window=completion_window, status=BatchStatus.VALIDATING, metadata_=metadata,
                  output_expires_after_seconds=output_expires_after_seconds, created_at=created,
                  expires_at=created + settings.completion_window_seconds, last_enqueued_at=created)
    session.add(batch)
    session.flush()
    return batch


def _check_metadata(metadata: Optional[dict[str, str]]) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise InvalidInput("Metadata can have at most 16 key-value pairs.", "metadata", "invalid_value")
    for key, value in metadata.items():
        if len(key) > 64:
            raise InvalidInput(f"Metadata key '{key[:64]}…' is longer than 64 characters.", f"metadata.{key[:64]}",
                               "invalid_value")
        if len(value) > 512:
            raise InvalidInput(f"Metadata value of '{key}' is longer than 512 characters.", f"metadata.{key}",
                               "invalid_value")


def get_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.project_id != project_id:
        raise NotFound("batch", batch_id)
    return batch


def list_batches(session: Session, project_id: str, *, after: Optional[str] = None, limit: int = 20,
                 statuses: Optional[Sequence[str]] = None, created_from: Optional[float] = None,
                 created_before: Optional[float] = None) -> tuple[list[Batch], bool]:
    """Newest first; ``after`` is the id of the last batch of the previous page. Optionally only
    the batches in ``statuses`` and those created in [``created_from``, ``created_before``)."""
    query = select(Batch).where(Batch.project_id == project_id)
    if statuses is not None:
        unknown = sorted(set(statuses) - set(BatchStatus.ALL))
        if unknown:
            raise InvalidInput(f"Invalid status '{unknown[0]}'. Supported values are: "
                               + ", ".join(f"'{s}'" for s in BatchStatus.ALL) + ".", "status", "invalid_value")
        query = query.where(Batch.status.in_(list(statuses)))
    if created_from is not None:
        query = query.where(Batch.created_at >= created_from)
    if created_before is not None:
        query = query.where(Batch.created_at < created_before)
    if after:
        cursor = session.get(Batch, after)
        if cursor is None or cursor.project_id != project_id:
            raise NotFound("batch", after, "after")
        query = query.where(tuple_(Batch.created_at, Batch.id) < tuple_(cursor.created_at, cursor.id))
    rows = list(session.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


MAX_BATCHES_AT_ONCE = 100


def get_batches(session: Session, project_id: str, batch_ids: Sequence[str]) -> list[Batch]:
    """Several of the project's batches at once, in the order asked (a live page's poll); NotFound
    names the first id that is not one of the project's batches."""
    if len(batch_ids) > MAX_BATCHES_AT_ONCE:
        raise InvalidInput(f"At most {MAX_BATCHES_AT_ONCE} batch ids at once (got {len(batch_ids)}).", "ids",
                           "invalid_value")
    found = {b.id: b for b in session.scalars(select(Batch).where(Batch.id.in_(list(set(batch_ids))),
                                                                  Batch.project_id == project_id))}
    for batch_id in batch_ids:
        if batch_id not in found:
            raise NotFound("batch", batch_id, "ids")
    return [found[batch_id] for batch_id in batch_ids]


def cancel_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    """Ask for cancellation (idempotent); the caller commits, then sends the cancel wake-up."""
    get_batch(session, project_id, batch_id)
    try:
        return request_cancel(session, batch_id)
    except InvalidTransition as exc:
        raise Conflict(str(exc), "invalid_state") from None

"""/v1/batches: create, list, retrieve, cancel, and retry the failed lines of an ended batch."""
from __future__ import annotations

import logging
import io
from typing import Callable, Optional

from fastapi import APIRouter, Body, Query
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nightshift.api.deps import CallerDep, ProjectCaller, SettingsDep, StoreDep
from nightshift.api.schemas.batches import BatchCreate, BatchObject, BatchRetry
from nightshift.api.schemas.common import ListPage
from nightshift.jobs.batches import retry as batch_retry
from nightshift.jobs.batches import service as batch_service
from nightshift.jobs.batches.anthropic_messages import MESSAGES
from nightshift.jobs.batches.documents import batch_document
from nightshift.jobs.batches.ingest import message_batch_file_bytes
from nightshift.jobs.batches.models import Batch
from nightshift.jobs.batches.progress import BatchProgress, batch_progress
from nightshift.jobs.files import uploads
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore
from nightshift.workers.dispatch import enqueue_cancel, enqueue_ingest

router = APIRouter(prefix="/v1/batches", tags=["batches"])
log = logging.getLogger(__name__)


def _wake(send: Callable[[str], None], batch_id: str) -> None:
    """Publish a wake-up after the commit. If the broker is unreachable the batch is still
    created/cancelled in the database, and the beat reconciler sends the message later."""
    try:
        send(batch_id)
    except Exception:  # noqa: BLE001 - any broker failure; the database already holds the truth
        log.exception("could not publish %s for %s; the reconciler will retry", send.__name__, batch_id)


def batch_object(batch: Batch, progress: BatchProgress) -> BatchObject:
    return BatchObject.model_validate(batch_document(batch, progress))


def _one(session, batch: Batch) -> BatchObject:  # noqa: ANN001
    return batch_object(batch, batch_progress(session, [batch])[batch.id])


@router.post("", response_model=BatchObject)
async def create_batch(body: BatchCreate, caller: CallerDep, settings: SettingsDep) -> BatchObject:
    def create(session: Session, project_id: str) -> BatchObject:
        batch = batch_service.create_batch(
            session, settings, project_id=project_id, input_file_id=body.input_file_id, endpoint=body.endpoint,
            completion_window=body.completion_window, metadata=body.metadata,
            output_expires_after_seconds=body.output_expires_after.seconds if body.output_expires_after else None)
        return _one(session, batch)

    batch = await caller.run(create)
    await run_in_threadpool(_wake, enqueue_ingest, batch.id)  # after the commit: the worker must find the row
    return batch


@router.get("", response_model=ListPage[BatchObject])
async def list_batches(caller: CallerDep, after: Optional[str] = None,
                       limit: int = Query(20, ge=1, le=100)) -> ListPage[BatchObject]:
    def page(session: Session, project_id: str) -> ListPage[BatchObject]:
        batches, has_more = batch_service.list_batches(session, project_id, after=after, limit=limit)
        progress = batch_progress(session, batches)
        return ListPage[BatchObject].of([batch_object(b, progress[b.id]) for b in batches], has_more)

    return await caller.read(page)


@router.get("/{batch_id}", response_model=BatchObject)
async def retrieve_batch(batch_id: str, caller: CallerDep) -> BatchObject:
    return await caller.read(lambda session, project_id:
                             _one(session, batch_service.get_batch(session, project_id, batch_id)))


async def cancel(caller: ProjectCaller, batch_id: str) -> BatchObject:
    """Ask for the batch's cancellation and, once that is committed, wake the cpu worker that
    drains it (the API's and the console's cancel)."""
    batch = await caller.run(lambda session, project_id:
                             _one(session, batch_service.cancel_batch(session, project_id, batch_id)))
    if batch.status == "cancelling":
        await run_in_threadpool(_wake, enqueue_cancel, batch.id)  # after the commit
    return batch


async def retry(caller: ProjectCaller, store: ObjectStore, settings: Settings, batch_id: str,
                error_codes: Optional[list[str]] = None, metadata: Optional[dict[str, str]] = None) -> BatchObject:
    """A new batch of the ended batch's failed lines (those with the given error codes, if any),
    linked both ways in metadata (``retry_of`` / ``retried_by``); the API's and the console's retry."""
    source = await caller.read(lambda session, project_id:
                               batch_retry.failed_lines(session, project_id, batch_id, error_codes))
    limits = ({"max_bytes": message_batch_file_bytes(settings), "max_lines": settings.max_message_batch_requests}
              if source.endpoint == MESSAGES else {})     # a message batch keeps Anthropic's limits
    upload = await run_in_threadpool(uploads.store_upload, store, settings, filename=f"{batch_id}_retry.jsonl",
                                     purpose="batch", source=io.BytesIO(source.jsonl), **limits)
    try:
        batch = await caller.run(lambda session, project:
                                 _one(session, batch_retry.create_retry_batch(session, settings, project_id=project,
                                                                              source=source, upload=upload,
                                                                              metadata=metadata)))
    except BaseException:
        await run_in_threadpool(store.delete, upload.object_key)
        raise
    await run_in_threadpool(_wake, enqueue_ingest, batch.id)  # after the commit
    return batch


@router.post("/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: str, caller: CallerDep) -> BatchObject:
    return await cancel(caller, batch_id)


@router.post("/{batch_id}/retry", response_model=BatchObject)
async def retry_batch(batch_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
                      body: Optional[BatchRetry] = Body(None)) -> BatchObject:
    """A new batch of the ended batch's failed lines (those with the given error codes, if
    any), linked both ways in metadata (``retry_of`` / ``retried_by``)."""
    body = body or BatchRetry()
    return await retry(caller, store, settings, batch_id, body.error_codes, body.metadata)

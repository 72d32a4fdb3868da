"""/v1/messages/batches: Anthropic's Message Batches API (create, list, retrieve, cancel, delete,
results) on the batches of /v1/batches. The official ``anthropic`` client works against it
unchanged (``x-api-key`` auth, Anthropic's error envelope: errors.py). What each call does to a
batch is jobs/batches/anthropic_batches.py; no SQL here."""
from __future__ import annotations

import logging
import tempfile
from typing import Any, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nightshift.api.deps import CallerDep, SettingsDep, StoreDep
from nightshift.api.errors import APIError
from nightshift.jobs.batches import anthropic_batches as message_batches
from nightshift.jobs.batches import service as batch_service
from nightshift.jobs.batches.ingest import message_batch_file_bytes
from nightshift.jobs.batches.models import Batch
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.files import uploads
from nightshift.workers.dispatch import enqueue_cancel, enqueue_ingest

router = APIRouter(prefix="/v1/messages/batches", tags=["message batches"])
log = logging.getLogger(__name__)

SPOOL_IN_MEMORY_BYTES = 8 * 1024 * 1024      # a create body beyond this spools to disk


def _wake(send, batch_id: str) -> None:  # noqa: ANN001
    """After the commit; an unreachable broker is caught up by the beat reconciler."""
    try:
        send(batch_id)
    except Exception:  # noqa: BLE001 - any broker failure; the database already holds the truth
        log.exception("could not publish %s for %s; the reconciler will retry", send.__name__, batch_id)


def _results_url(request: Request, batch_id: str) -> str:
    return f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{batch_id}/results"


def _documents(session: Session, request: Request, batches: list[Batch]) -> list[dict[str, Any]]:
    progress = batch_progress(session, batches)
    outcomes = message_batches.outcome_counts(session, batches)
    return [message_batches.message_batch_document(b, progress[b.id], outcomes.get(b.id), _results_url(request, b.id))
            for b in batches]


def _one(session: Session, request: Request, batch: Batch) -> dict[str, Any]:
    return _documents(session, request, [batch])[0]


async def _spool_body(request: Request, limit: int) -> tempfile.SpooledTemporaryFile:
    """The request body in a spooled file (memory, then disk), refused once over ``limit``."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES)
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"Request exceeds the maximum size of {limit} bytes for a message batch.",
                               code="request_too_large")
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


@router.post("")
async def create_message_batch(request: Request, caller: CallerDep, store: StoreDep,
                               settings: SettingsDep) -> dict[str, Any]:
    body = await _spool_body(request, settings.max_message_batch_bytes)

    def convert_and_store() -> tuple[uploads.StoredUpload, int]:
        with body, tempfile.TemporaryFile() as lines:
            count = message_batches.convert_requests(body, lines, settings.max_message_batch_requests)
            lines.seek(0)
            upload = uploads.store_upload(store, settings, filename="message_batch_requests.jsonl", purpose="batch",
                                          source=lines, max_bytes=message_batch_file_bytes(settings),
                                          max_lines=settings.max_message_batch_requests)
            return upload, count

    upload, count = await run_in_threadpool(convert_and_store)

    def create(session: Session, project_id: str) -> dict[str, Any]:
        file = uploads.record_file(session, project_id, upload)
        batch = message_batches.create_message_batch(session, settings, project_id=project_id,
                                                     input_file_id=file.id, requests=count)
        return _one(session, request, batch)

    try:
        document = await caller.run(create)
    except BaseException:
        await run_in_threadpool(store.delete, upload.object_key)
        raise
    await run_in_threadpool(_wake, enqueue_ingest, document["id"])   # after the commit
    return document


@router.get("")
async def list_message_batches(request: Request, caller: CallerDep, before_id: Optional[str] = None,
                               after_id: Optional[str] = None,
                               limit: int = Query(20, ge=1, le=1000)) -> dict[str, Any]:
    def page(session: Session, project_id: str) -> dict[str, Any]:
        batches, has_more = message_batches.list_message_batches(session, project_id, before_id=before_id,
                                                                 after_id=after_id, limit=limit)
        data = _documents(session, request, batches)
        return {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    return await caller.read(page)


@router.get("/{message_batch_id}")
async def retrieve_message_batch(message_batch_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
    return await caller.read(lambda session, project_id: _one(
        session, request, message_batches.get_message_batch(session, project_id, message_batch_id)))


@router.post("/{message_batch_id}/cancel")
async def cancel_message_batch(message_batch_id: str, request: Request, caller: CallerDep) -> dict[str, Any]:
    def cancel(session: Session, project_id: str) -> dict[str, Any]:
        message_batches.get_message_batch(session, project_id, message_batch_id)
        batch = session.get(Batch, message_batch_id)
        if batch.status not in message_batches.ENDED:
            batch = batch_service.cancel_batch(session, project_id, message_batch_id)
        return _one(session, request, batch)

    document = await caller.run(cancel)
    if document["processing_status"] == "canceling":
        await run_in_threadpool(_wake, enqueue_cancel, message_batch_id)   # after the commit
    return document


@router.delete("/{message_batch_id}")
async def delete_message_batch(message_batch_id: str, caller: CallerDep) -> dict[str, Any]:
    await caller.run(lambda session, project_id: message_batches.delete_message_batch(session, project_id,
                                                                                       message_batch_id))
    return {"id": message_batch_id, "type": "message_batch_deleted"}


@router.get("/{message_batch_id}/results")
async def message_batch_results(message_batch_id: str, caller: CallerDep, store: StoreDep) -> StreamingResponse:
    # The sources are read and the session closed before the first byte: a slow reader holds no connection.
    sources = await caller.read(lambda session, project_id: message_batches.result_sources(
        session, message_batches.get_message_batch(session, project_id, message_batch_id)))
    return StreamingResponse(message_batches.results_lines(store, sources), media_type="application/x-jsonl")

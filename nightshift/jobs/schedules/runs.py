"""A schedule run's life after it fired: start (select changed documents, write the batch
input file, create the batch) and publish (write one output per document under the index
prefix, record what was indexed, for an embeddings schedule write the run's vector index file
(embedding_index.py), write the manifest).

Both steps lock the run row and check its status first, so a duplicated Celery message or
a second caller does nothing: the batch is created in the same transaction that moves the
run from PENDING to SUBMITTED.
"""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus
from nightshift.jobs.batches.service import create_batch
from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.files.uploads import create_file
from nightshift.jobs.schedules.embedding_index import (EMBEDDINGS, index_entry, index_file_key,
                                                       previous_index_file, read_index, vectors_of, write_index)
from nightshift.jobs.schedules.models import IndexedDocument, RunStatus, Schedule, ScheduleRun
from nightshift.jobs.schedules.reindex import build_manifest, manifest_key, output_document, output_key
from nightshift.jobs.schedules.run_inputs import RunInputError, collect_input
from nightshift.jobs.webhooks.events import record_event
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore


def _lock_run(session: Session, run_id: str) -> Optional[ScheduleRun]:
    return session.scalars(select(ScheduleRun).where(ScheduleRun.id == run_id)
                           .with_for_update()).first()


def start_run(session: Session, store: ObjectStore, settings: Settings, run_id: str, *,
              now: Optional[float] = None) -> Optional[str]:
    """Start a PENDING run. Returns the id of the batch created (the caller enqueues its
    ingest after committing), or None when there was nothing to do or nothing to send."""
    now = time.time() if now is None else now
    run = _lock_run(session, run_id)
    if run is None or run.status != RunStatus.PENDING:
        return None
    schedule = session.get(Schedule, run.schedule_id)
    try:
        collected = collect_input(session, schedule, store, settings)
    except (RunInputError, KeyError) as exc:
        _fail(session, schedule, run, str(exc), now)
        return None
    run.documents_total = len(collected.current)
    run.documents_selected = len(collected.changed)
    run.selection, run.removed = collected.changed, collected.removed
    if not collected.changed:
        _publish(session, store, schedule, run, batch=None, now=now)
        return None
    metadata = dict(schedule.metadata_ or {})
    metadata.update({"schedule_id": schedule.id, "schedule_run_id": run.id})
    try:
        # the same two steps as POST /v1/files + POST /v1/batches
        file = create_file(session, store, settings, project_id=schedule.project_id,
                           filename=f"{schedule.name}-{run.id}.jsonl", purpose="batch",
                           source=collected.spool)
        batch = create_batch(session, settings, project_id=schedule.project_id,
                             input_file_id=file.id, endpoint=schedule.endpoint,
                             completion_window=schedule.completion_window, metadata=metadata)
    except InvalidInput as exc:   # e.g. more changed documents than a batch may hold
        _fail(session, schedule, run, exc.message, now)
        return None
    run.batch_id, run.input_file_id, run.status = batch.id, file.id, RunStatus.SUBMITTED
    return batch.id


def run_document(run: ScheduleRun) -> dict:
    """A run as the API shows it (``schedule.run``)."""
    return {"id": run.id, "object": "schedule.run", "schedule_id": run.schedule_id, "due_at": int(run.due_at),
            "fired_at": int(run.fired_at), "status": run.status, "batch_id": run.batch_id,
            "input_file_id": run.input_file_id, "documents_total": run.documents_total,
            "documents_selected": run.documents_selected, "documents_indexed": run.documents_indexed,
            "documents_failed": run.documents_failed, "documents_removed": run.documents_removed,
            "error": run.error, "finished_at": int(run.finished_at) if run.finished_at is not None else None}


def _fail(session: Session, schedule: Schedule, run: ScheduleRun, error: str, now: float) -> None:
    """The run failed: its status, and the schedule_run.failed event for the project's webhooks
    (in this transaction)."""
    run.status, run.error, run.finished_at = RunStatus.FAILED, error, now
    session.flush()
    record_event(session, schedule.project_id, "schedule_run.failed", run.id, run_document(run), now)


def _upsert_indexed(session: Session, values: dict) -> None:
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(IndexedDocument).values(**values)
    session.execute(stmt.on_conflict_do_update(
        index_elements=["schedule_id", "doc_key"],
        set_={k: stmt.excluded[k] for k in ("sha256", "output_key", "run_id", "batch_id", "indexed_at")}))


def _publish(session: Session, store: ObjectStore, schedule: Schedule, run: ScheduleRun,
             batch: Optional[Batch], now: float) -> None:
    indexed_at = int(now)
    indexed = failed = 0
    embeddings = schedule.endpoint == EMBEDDINGS
    fresh: dict[str, dict] = {}          # embeddings: this run's index entries
    if batch is not None:
        selection = run.selection or {}
        answered = session.execute(
            select(Request.custom_id, Request.status, Request.response_body)
            .where(Request.batch_id == batch.id).execution_options(yield_per=500))
        for custom_id, status, body in answered:
            if status != RequestStatus.COMPLETED or custom_id not in selection:
                failed += 1   # not recorded as indexed: the next run sends it again
                continue
            key = output_key(schedule.index_prefix, custom_id)
            if embeddings:
                vectors = vectors_of(body)
                if vectors:
                    fresh[custom_id] = index_entry(custom_id, selection[custom_id], vectors)
            store.put_stream(key, output_document(
                document_key=custom_id, sha256=selection[custom_id], run_id=run.id,
                batch_id=batch.id, indexed_at=indexed_at, response_body=body))
            _upsert_indexed(session, {"schedule_id": schedule.id, "doc_key": custom_id,
                                      "sha256": selection[custom_id], "output_key": key,
                                      "run_id": run.id, "batch_id": batch.id, "indexed_at": now})
            indexed += 1
    for doc_key in run.removed or []:
        store.delete(output_key(schedule.index_prefix, doc_key))
    if run.removed:
        session.execute(delete(IndexedDocument).where(IndexedDocument.schedule_id == schedule.id,
                                                      IndexedDocument.doc_key.in_(run.removed)))
    ok = batch is None or batch.status == BatchStatus.COMPLETED
    run.documents_indexed, run.documents_failed = indexed, failed
    run.documents_removed = len(run.removed or [])
    if ok:
        run.status, run.error, run.finished_at = RunStatus.SUCCEEDED, None, now
    else:
        _fail(session, schedule, run, f"batch {batch.id} ended {batch.status}", now)
    session.flush()
    documents = {
        d.doc_key: {"sha256": d.sha256, "output_key": d.output_key, "indexed_at": int(d.indexed_at),
                    "run_id": d.run_id, "batch_id": d.batch_id}
        for d in session.scalars(select(IndexedDocument).where(IndexedDocument.schedule_id == schedule.id))}
    index_file = None
    if embeddings:
        index_file = index_file_key(schedule.index_prefix, run.id)
        previous = read_index(store, previous_index_file(store, manifest_key(schedule.index_prefix)))
        write_index(store, index_file, documents, fresh, previous)
    store.put_stream(manifest_key(schedule.index_prefix), build_manifest(
        schedule_id=schedule.id, index_prefix=schedule.index_prefix, updated_at=indexed_at,
        last_run={"id": run.id, "due_at": int(run.due_at), "batch_id": run.batch_id,
                  "status": run.status, "documents_total": run.documents_total,
                  "documents_selected": run.documents_selected, "documents_indexed": indexed,
                  "documents_failed": failed, "documents_removed": run.documents_removed},
        documents=documents, index_file=index_file))


def publish_batch_results(session: Session, store: ObjectStore, batch_id: str, *,
                          now: Optional[float] = None) -> bool:
    """Complete the schedule run of a batch that reached a terminal status: if the run is
    still SUBMITTED, publish the batch's results under the index prefix. True if it published.
    Called after finalize (the finalize task) and by the beat tick as a safety net."""
    now = time.time() if now is None else now
    run = session.scalars(select(ScheduleRun).where(ScheduleRun.batch_id == batch_id)
                          .with_for_update()).first()
    if run is None or run.status != RunStatus.SUBMITTED:
        return False
    batch = session.get(Batch, batch_id)
    if batch is None or batch.status not in BatchStatus.TERMINAL:
        return False
    _publish(session, store, session.get(Schedule, run.schedule_id), run, batch, now)
    return True


def finished_submitted_runs(session: Session) -> list[str]:
    """Batch ids of SUBMITTED runs whose batch is terminal (the beat publishes them)."""
    return list(session.scalars(
        select(ScheduleRun.batch_id).join(Batch, Batch.id == ScheduleRun.batch_id)
        .where(ScheduleRun.status == RunStatus.SUBMITTED, Batch.status.in_(BatchStatus.TERMINAL))))

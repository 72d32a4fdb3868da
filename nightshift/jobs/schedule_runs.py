"""A schedule run's life after it fired: start (select changed documents, write the batch
input file, create the batch) and publish (write one output per document under the index
prefix, record what was indexed, write the manifest).

Both steps lock the run row and check its status first, so a duplicated Celery message or
a second caller does nothing: the batch is created in the same transaction that moves the
run from PENDING to SUBMITTED.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional

import orjson
from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.batch_queries import create_batch
from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.files import create_file
from nightshift.jobs.models import Batch, BatchStatus, File, Request, RequestStatus
from nightshift.jobs.reindex import (TemplateRenderError, build_manifest, content_hash, manifest_key,
                          output_document, output_key, render_body, request_line, select_changed)
from nightshift.jobs.schedule_models import IndexedDocument, RunStatus, Schedule, ScheduleRun
from nightshift.settings import Settings, get_settings
from nightshift.storage.listing import list_keys
from nightshift.storage.objectstore import ObjectStore, iter_lines

SessionFactory = Callable[[], Session]


class RunInputError(ValueError):
    """The run's source cannot be turned into requests (named document or line)."""


@dataclass
class _Input:
    current: dict[str, str]        # document key -> sha256, every document of the source
    changed: dict[str, str]        # the subset sent in this run
    spool: tempfile.SpooledTemporaryFile
    removed: list[str]


def _lock_run(session: Session, run_id: str) -> Optional[ScheduleRun]:
    return session.scalars(select(ScheduleRun).where(ScheduleRun.id == run_id)
                           .with_for_update()).first()


def _indexed(session: Session, schedule_id: str) -> dict[str, str]:
    return dict(session.execute(select(IndexedDocument.doc_key, IndexedDocument.sha256)
                                .where(IndexedDocument.schedule_id == schedule_id)).all())


def _read(store: ObjectStore, key: str, limit: int) -> bytes:
    data = bytearray()
    for chunk in store.get_stream(key):
        data += chunk
        if len(data) > limit:
            raise RunInputError(f"document {key!r} is larger than {limit} bytes")
    return bytes(data)


def _documents_input(schedule: Schedule, store: ObjectStore, indexed: dict[str, str],
                     spool, settings: Settings) -> dict[str, str]:
    """Documents under a prefix: each object is one document, keyed relative to the prefix."""
    prefix = schedule.source["prefix"]
    current: dict[str, str] = {}
    for key in list_keys(store, prefix):
        if schedule.index_prefix and key.startswith(schedule.index_prefix):
            continue  # never feed our own outputs back in
        doc_key = key[len(prefix):]
        data = _read(store, key, settings.max_file_bytes)
        digest = current[doc_key] = content_hash(data)
        if indexed.get(doc_key) == digest:
            continue
        try:
            body = render_body(schedule.prompt_template, document=data.decode("utf-8", "replace"),
                               key=doc_key)
        except TemplateRenderError as exc:
            raise RunInputError(str(exc)) from exc
        spool.write(request_line(custom_id=doc_key, endpoint=schedule.endpoint, body=body,
                                 model=schedule.model))
    return current


def _request_lines_input(sources: list[tuple[str, str]], store: ObjectStore,
                         indexed: dict[str, str], spool) -> dict[str, str]:
    """JSONL objects ((label, object key) pairs): each line is one complete request and one
    document, keyed by its custom_id, which must be unique across all of them."""
    current: dict[str, str] = {}
    origin: dict[str, str] = {}
    for label, key in sources:
        for number, raw in enumerate(iter_lines(store.get_stream(key)), start=1):
            raw = raw.strip()
            if not raw:
                continue
            try:
                custom_id = orjson.loads(raw)["custom_id"]
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise RunInputError(f"{label} line {number}: no custom_id ({exc})") from exc
            if not isinstance(custom_id, str):
                raise RunInputError(f"{label} line {number}: custom_id must be a string")
            if custom_id in current:
                raise RunInputError(f"{label} line {number}: custom_id {custom_id!r} is already used "
                                    f"by {origin[custom_id]}")
            origin[custom_id] = f"{label} line {number}"
            digest = current[custom_id] = content_hash(raw)
            if indexed.get(custom_id) != digest:
                spool.write(raw + b"\n")
    return current


def _file_input(session: Session, schedule: Schedule, store: ObjectStore,
                indexed: dict[str, str], spool) -> dict[str, str]:
    """A stored JSONL file: each line is one document, keyed by its custom_id."""
    file = session.get(File, schedule.source["file_id"])
    if file is None or file.deleted_at is not None:
        raise RunInputError(f"source file {schedule.source['file_id']!r} no longer exists")
    return _request_lines_input([(f"source file {file.id}", file.object_key)], store, indexed, spool)


def _jsonl_prefix_input(schedule: Schedule, store: ObjectStore, indexed: dict[str, str],
                        spool) -> dict[str, str]:
    """Every .jsonl object under the prefix holds request lines."""
    objects = [(key, key) for key in list_keys(store, schedule.source["prefix"])
               if key.endswith(".jsonl") and not (schedule.index_prefix and key.startswith(schedule.index_prefix))]
    return _request_lines_input(objects, store, indexed, spool)


def _collect_input(session: Session, schedule: Schedule, store: ObjectStore,
                   settings: Settings) -> _Input:
    indexed = _indexed(session, schedule.id)
    spool = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)
    if schedule.source["type"] == "prefix" and schedule.source.get("format") == "jsonl":
        current = _jsonl_prefix_input(schedule, store, indexed, spool)
    elif schedule.source["type"] == "prefix":
        current = _documents_input(schedule, store, indexed, spool, settings)
    else:
        current = _file_input(session, schedule, store, indexed, spool)
    selection = select_changed(current, indexed)
    spool.seek(0)
    return _Input(current, {k: current[k] for k in selection.changed}, spool, selection.removed)


def start_run(session_factory: SessionFactory, store: ObjectStore, run_id: str, *,
              now: Optional[float] = None, settings: Optional[Settings] = None) -> Optional[str]:
    """Start a PENDING run. Returns the id of the batch created (the caller enqueues its
    ingest after this commit), or None when there was nothing to do or nothing to send."""
    settings = settings or get_settings()
    now = time.time() if now is None else now
    with session_factory() as session, session.begin():
        run = _lock_run(session, run_id)
        if run is None or run.status != RunStatus.PENDING:
            return None
        schedule = session.get(Schedule, run.schedule_id)
        try:
            collected = _collect_input(session, schedule, store, settings)
        except (RunInputError, KeyError) as exc:
            run.status, run.error, run.finished_at = RunStatus.FAILED, str(exc), now
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
            run.status, run.error, run.finished_at = RunStatus.FAILED, exc.message, now
            return None
        run.batch_id, run.input_file_id, run.status = batch.id, file.id, RunStatus.SUBMITTED
        return batch.id


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
    run.status = RunStatus.SUCCEEDED if ok else RunStatus.FAILED
    run.error = None if ok else f"batch {batch.id} ended {batch.status}"
    run.documents_indexed, run.documents_failed = indexed, failed
    run.documents_removed = len(run.removed or [])
    run.finished_at = now
    session.flush()
    documents = {
        d.doc_key: {"sha256": d.sha256, "output_key": d.output_key, "indexed_at": int(d.indexed_at),
                    "run_id": d.run_id, "batch_id": d.batch_id}
        for d in session.scalars(select(IndexedDocument).where(IndexedDocument.schedule_id == schedule.id))}
    store.put_stream(manifest_key(schedule.index_prefix), build_manifest(
        schedule_id=schedule.id, index_prefix=schedule.index_prefix, updated_at=indexed_at,
        last_run={"id": run.id, "due_at": int(run.due_at), "batch_id": run.batch_id,
                  "status": run.status, "documents_total": run.documents_total,
                  "documents_selected": run.documents_selected, "documents_indexed": indexed,
                  "documents_failed": failed, "documents_removed": run.documents_removed},
        documents=documents))


def publish_batch_results(session: Session, store: ObjectStore, batch_id: str, *,
                          now: Optional[float] = None) -> bool:
    """Called when a batch reaches a terminal status (finalize, or the beat sweep): if it
    belongs to a schedule run still SUBMITTED, publish its results. True if it published."""
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


@dataclass
class TickResult:
    fired: list[str]        # new runs to start
    restart: list[str]      # runs still PENDING long after firing (start message lost)
    published: list[str]    # batches whose results were published by this tick


def schedule_tick(session_factory: SessionFactory, store: ObjectStore, *, now: float,
                  settings: Optional[Settings] = None) -> TickResult:
    """One beat tick: fire due schedules, find runs whose start was lost, and publish the
    results of finished scheduled batches that finalize did not publish (safety net)."""
    from nightshift.jobs.schedules import fire_due_schedules, stale_pending_runs

    settings = settings or get_settings()
    with session_factory() as session, session.begin():
        # a SUBMITTED run whose batch row was deleted would block its schedule forever
        session.execute(update(ScheduleRun).where(ScheduleRun.status == RunStatus.SUBMITTED,
                                                  ScheduleRun.batch_id.is_(None))
                        .values(status=RunStatus.FAILED, error="its batch was deleted", finished_at=now))
    fired = fire_due_schedules(session_factory, now)
    with session_factory() as session:
        stale = stale_pending_runs(session, now, settings.schedule_start_retry_seconds)
        finished = finished_submitted_runs(session)
    published = []
    for batch_id in finished:
        with session_factory() as session, session.begin():
            if publish_batch_results(session, store, batch_id, now=now):
                published.append(batch_id)
    return TickResult(fired, [r for r in stale if r not in fired], published)

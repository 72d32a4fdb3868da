"""Finalize a batch: write output.jsonl and errors.jsonl (input line order) to the object
store, register them as files with the cost report, and move the batch to its terminal status.

Three steps, each in the caller's transaction (``nightshift.workers.finalize`` owns them):
``prepare_finalize`` (take the finalize lease, drain a cancelling batch, decide the terminal
status), then ``write_result_files`` (reads the rows, writes the objects; the caller renews
the lease meanwhile with ``renew_finalize_lease``), then ``complete_finalize``. The lease keeps
a second finalize (a re-sent message) from running beside a live one; one whose holder died
runs out, and the reconciler sends the finalize again.
Idempotent: object keys and file ids are derived from the batch id, so a retried finalize
overwrites its own objects and finds its own file rows; the last step is a conditional
UPDATE from the status finalize started in.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

import orjson
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches.documents import batch_document
from nightshift.jobs.batches.lifecycle import batch_status, drain_batch, final_status
from nightshift.jobs.batches.model_waits import MODEL_UNAVAILABLE
from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.costs.batch_costs import write_cost_files
from nightshift.jobs.files.service import upsert_result_file
from nightshift.jobs.ids import batch_request_id, derived_id, response_request_id
from nightshift.jobs.webhooks.events import record_event
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore

FINALIZABLE = (BatchStatus.FINALIZING, BatchStatus.CANCELLING)
_FLUSH = 1024 * 1024
_STAMPS = {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
           BatchStatus.FAILED: "failed_at"}


@dataclass(frozen=True)
class FinalizePlan:
    batch_id: str
    project_id: str
    from_status: str          # the status finalize started in (its last write is conditional on it)
    target: str               # the terminal status it moves the batch to
    lease_expires_at: float   # the finalize lease as this finalize took it
    errors: Optional[dict] = None   # the batch's errors object when it fails (no request could run)


@dataclass(frozen=True)
class ResultFiles:
    output_key: str
    output_bytes: int
    output_lines: int
    error_key: str
    error_bytes: int
    error_lines: int


@dataclass
class FinalizeOutcome:
    status: str               # the batch's status afterwards
    output_lines: int = 0
    error_lines: int = 0


def prepare_finalize(s: Session, batch_id: str, lease_seconds: float,
                     now: Optional[float] = None) -> Optional[FinalizePlan]:
    """Take the batch's finalize lease and plan the finalize; None if the batch is not
    finalizing or cancelling, or another finalize holds a live lease (nothing to do). A
    cancelling batch has its unrun requests drained here."""
    now = time.time() if now is None else now
    expires = now + lease_seconds
    taken = s.execute(update(Batch).where(
        Batch.id == batch_id, Batch.status.in_(FINALIZABLE),
        or_(Batch.finalize_lease_expires_at.is_(None), Batch.finalize_lease_expires_at < now))
        .values(finalize_lease_expires_at=expires))
    batch = s.get(Batch, batch_id, populate_existing=True)
    if batch is None:
        raise LookupError(batch_id)
    if taken.rowcount != 1:
        return None
    if batch.status == BatchStatus.CANCELLING:
        drain_batch(s, batch_id, "batch_cancelled", now)
    target = final_status(batch)
    cause = _why_nothing_ran(s, batch_id) if target == BatchStatus.COMPLETED else None
    if cause is not None:   # every request ended model_unavailable: the batch failed
        return FinalizePlan(batch_id, batch.project_id, batch.status, BatchStatus.FAILED, expires,
                            {"object": "list", "data": [{"code": MODEL_UNAVAILABLE, "message": cause, "param": None,
                                                         "line": None}]})
    return FinalizePlan(batch_id, batch.project_id, batch.status, target, expires)


def _why_nothing_ran(s: Session, batch_id: str) -> Optional[str]:
    """The model_unavailable message when every request of the batch ended with it (none ran)."""
    ran = s.scalar(select(Request.id).where(Request.batch_id == batch_id, or_(
        Request.error_code.is_(None), Request.error_code != MODEL_UNAVAILABLE)).limit(1))
    if ran is not None:
        return None
    return s.scalar(select(Request.error_message).where(Request.batch_id == batch_id).limit(1))


def renew_finalize_lease(s: Session, batch_id: str, lease_seconds: float) -> float:
    """Extend the running finalize's lease; returns its new expiry."""
    expires = time.time() + lease_seconds
    s.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(FINALIZABLE))
              .values(finalize_lease_expires_at=expires))
    return expires


def release_finalize_lease(s: Session, batch_id: str, expires_at: float) -> bool:
    """A finalize that failed hands its lease back, if it is still the one it took or last
    renewed (``expires_at``), so the reconciler sends the finalize again at once instead of when
    the lease runs out. True if it was handed back."""
    res = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(FINALIZABLE),
                                        Batch.finalize_lease_expires_at == expires_at)
                    .values(finalize_lease_expires_at=None))
    return res.rowcount == 1


def result_line(row: Request) -> tuple[bool, bytes]:
    """(is_output, JSONL line) for one terminal request, shaped like OpenAI's batch output."""
    if row.status == RequestStatus.COMPLETED or row.response_body is not None:
        response = {"status_code": row.response_status_code or 200, "request_id": response_request_id(row.id),
                    "body": row.response_body}
        obj = {"id": batch_request_id(row.id), "custom_id": row.custom_id, "response": response, "error": None}
        return row.status == RequestStatus.COMPLETED, orjson.dumps(obj) + b"\n"
    obj = {"id": batch_request_id(row.id), "custom_id": row.custom_id, "response": None,
           "error": {"code": row.error_code, "message": row.error_message}}
    return False, orjson.dumps(obj) + b"\n"


class _Splitter:
    """Streams the batch's rows once, feeding the output lines to the store as they come and
    spooling the error lines to a temporary file (written to the store after)."""

    def __init__(self, s: Session, batch_id: str, error_spool: BinaryIO):
        self.s, self.batch_id, self.error_spool = s, batch_id, error_spool
        self.output_lines = self.error_lines = 0

    def output_chunks(self) -> Iterator[bytes]:
        buf = bytearray()
        rows = self.s.execute(select(Request).where(Request.batch_id == self.batch_id).order_by(Request.line)
                              .execution_options(yield_per=2000)).scalars()
        for row in rows:
            if row.status == RequestStatus.PENDING:
                raise RuntimeError(f"batch {self.batch_id}: request {row.custom_id!r} is still pending")
            is_output, line = result_line(row)
            if is_output:
                self.output_lines += 1
                buf += line
                if len(buf) >= _FLUSH:
                    yield bytes(buf)
                    buf.clear()
            else:
                self.error_lines += 1
                self.error_spool.write(line)
        if buf:
            yield bytes(buf)


def write_result_files(s: Session, store: ObjectStore, batch_id: str) -> ResultFiles:
    """Write output.jsonl and errors.jsonl from the batch's rows (every row must be terminal);
    only reads the database. A file with no lines is not left in the store (its file id stays
    null, as OpenAI leaves error_file_id null when nothing failed)."""
    out_key, err_key = f"batches/{batch_id}/output.jsonl", f"batches/{batch_id}/errors.jsonl"
    with tempfile.TemporaryFile() as error_spool:
        splitter = _Splitter(s, batch_id, error_spool)
        out_size = store.put_stream(out_key, splitter.output_chunks())
        if not splitter.output_lines:
            store.delete(out_key)
        err_size = 0
        if splitter.error_lines:
            error_spool.seek(0)
            err_size = store.put_stream(err_key, error_spool)
        else:
            store.delete(err_key)     # a retried finalize may find one from an earlier attempt
    return ResultFiles(out_key, out_size, splitter.output_lines, err_key, err_size, splitter.error_lines)


def complete_finalize(s: Session, store: ObjectStore, settings: Settings, plan: FinalizePlan,
                      files: ResultFiles, now: Optional[float] = None) -> FinalizeOutcome:
    """Move the batch from the status finalize started in to its terminal status, register the
    result files and write the cost report. If the batch moved meanwhile (another finalize
    won), nothing is written and the outcome carries its current status."""
    now = time.time() if now is None else now
    out_id = derived_id("file-", plan.batch_id, "output") if files.output_lines else None
    err_id = derived_id("file-", plan.batch_id, "errors") if files.error_lines else None
    values = {"status": plan.target, "output_file_id": out_id, "error_file_id": err_id,
              "finalize_lease_expires_at": None}
    if plan.target in _STAMPS:  # expired_at was stamped when the window closed
        values[_STAMPS[plan.target]] = now
    if plan.errors is not None:
        values["errors"] = plan.errors
    res = s.execute(update(Batch).where(Batch.id == plan.batch_id, Batch.status == plan.from_status)
                    .values(**values))
    if res.rowcount != 1:
        return FinalizeOutcome(batch_status(s, plan.batch_id))
    batch = s.get(Batch, plan.batch_id, populate_existing=True)
    # output_expires_after (from the create request) applies to the output and error files; the
    # expired-files sweep removes them then. Without it they are kept until deleted.
    ttl = batch.output_expires_after_seconds
    expires_at = now + ttl if ttl is not None else None
    if out_id:
        upsert_result_file(s, file_id=out_id, project_id=plan.project_id, filename=f"{plan.batch_id}_output.jsonl",
                           object_key=files.output_key, size=files.output_bytes, lines=files.output_lines, now=now,
                           expires_at=expires_at)
    if err_id:
        upsert_result_file(s, file_id=err_id, project_id=plan.project_id, filename=f"{plan.batch_id}_error.jsonl",
                           object_key=files.error_key, size=files.error_bytes, lines=files.error_lines, now=now,
                           expires_at=expires_at)
    write_cost_files(s, store, batch, settings=settings, now=now)
    record_event(s, plan.project_id, f"batch.{plan.target}", plan.batch_id,
                 batch_document(batch, batch_progress(s, [batch])[batch.id]), now)
    return FinalizeOutcome(plan.target, files.output_lines, files.error_lines)

"""Finalize a batch: write output.jsonl and errors.jsonl (input line order) to the object
store, register them as files, and move the batch to its terminal status.

Idempotent: object keys and file ids are derived from the batch id, so a retried finalize
overwrites its own objects and finds its own file rows; the last step is a conditional
UPDATE from the status it started in.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import orjson
from sqlalchemy import select, update

from nightshift.jobs.batches import drain_batch, final_status
from nightshift.jobs.finalize_hooks import after_finalize
from nightshift.jobs.ids import batch_request_id, derived_id, response_request_id
from nightshift.jobs.models import Batch, BatchStatus, File, Request, RequestStatus
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore, get_object_store

log = logging.getLogger(__name__)
FINALIZABLE = (BatchStatus.FINALIZING, BatchStatus.CANCELLING)
_FLUSH = 1024 * 1024


@dataclass
class FinalizeOutcome:
    status: str
    output_lines: int = 0
    error_lines: int = 0


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
    """Streams the batch's rows once, feeding two chunk generators (output and error lines)."""

    def __init__(self, batch_id: str, db_url: Optional[str], spool_dir: Optional[str] = None):
        import tempfile

        self.error_file = tempfile.TemporaryFile(dir=spool_dir)
        self.batch_id, self.db_url = batch_id, db_url
        self.output_lines = self.error_lines = 0

    def output_chunks(self) -> Iterator[bytes]:
        buf = bytearray()
        with session_scope(self.db_url) as s:
            rows = s.execute(select(Request).where(Request.batch_id == self.batch_id).order_by(Request.line)
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
                    self.error_file.write(line)
        if buf:
            yield bytes(buf)


def _register_file(s, file_id: str, project_id: str, filename: str, key: str, size: int, lines: int,  # noqa: ANN001
                   now: float) -> None:
    if s.get(File, file_id) is None:
        s.add(File(id=file_id, project_id=project_id, filename=filename, purpose="batch_output", bytes=size,
                   object_key=key, status="processed", line_count=lines, created_at=now))
    else:
        s.execute(update(File).where(File.id == file_id).values(bytes=size, line_count=lines, deleted_at=None))


def finalize_batch(batch_id: str, *, store: Optional[ObjectStore] = None, db_url: Optional[str] = None,
                   now: Optional[float] = None) -> FinalizeOutcome:
    store = store or get_object_store()
    with session_scope(db_url) as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            raise LookupError(batch_id)
        if batch.status not in FINALIZABLE:
            return FinalizeOutcome(batch.status)
        if batch.status == BatchStatus.CANCELLING:
            drain_batch(s, batch_id, "batch_cancelled", now)
        start_status, project_id = batch.status, batch.project_id
        target = final_status(batch)

    splitter = _Splitter(batch_id, db_url)
    out_key, err_key = f"batches/{batch_id}/output.jsonl", f"batches/{batch_id}/errors.jsonl"
    try:
        out_size = store.put_stream(out_key, splitter.output_chunks())
        splitter.error_file.seek(0)
        err_size = store.put_stream(err_key, splitter.error_file)
    finally:
        splitter.error_file.close()

    now = time.time() if now is None else now
    out_id = derived_id("file-", batch_id, "output") if splitter.output_lines else None
    err_id = derived_id("file-", batch_id, "errors") if splitter.error_lines else None
    with session_scope(db_url) as s:
        if out_id:
            _register_file(s, out_id, project_id, f"{batch_id}_output.jsonl", out_key, out_size,
                           splitter.output_lines, now)
        if err_id:
            _register_file(s, err_id, project_id, f"{batch_id}_error.jsonl", err_key, err_size,
                           splitter.error_lines, now)
        stamp = {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
                 BatchStatus.EXPIRED: "expired_at"}[target]
        values = {"status": target, "output_file_id": out_id, "error_file_id": err_id}
        if target != BatchStatus.EXPIRED:  # expired_at was stamped when the window closed
            values[stamp] = now
        res = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == start_status).values(**values))
        if res.rowcount != 1:
            s.rollback()
            return FinalizeOutcome(s.get(Batch, batch_id).status)
        # issue 6: cost.json/cost.csv and a scheduled run's index outputs, in this transaction
        after_finalize(s, store, s.get(Batch, batch_id), now=now)
    log.info("finalized batch %s -> %s (%d output, %d error lines)", batch_id, target, splitter.output_lines,
             splitter.error_lines)
    return FinalizeOutcome(target, splitter.output_lines, splitter.error_lines)

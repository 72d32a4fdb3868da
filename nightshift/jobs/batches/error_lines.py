"""The first lines of a batch's error file, read from its request rows: available while the
batch runs (the error file is written only at finalize) and exactly as the file will hold them
(``finalize.result_line``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.finalize import result_line
from nightshift.jobs.batches.models import Batch, Request, RequestStatus
from nightshift.jobs.batches.retry import error_code_of


@dataclass(frozen=True)
class ErrorLine:
    line: int                  # of the input file (1-based)
    custom_id: str
    code: Optional[str]
    message: Optional[str]
    jsonl: str                 # the error file's line


def _message(row: Request) -> Optional[str]:
    body = row.response_body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("message") or row.error_message
    return row.error_message


def first_error_lines(session: Session, batch: Batch, limit: int = 5) -> list[ErrorLine]:
    """The batch's first ``limit`` failed requests in input order. A batch that failed validation
    has no request rows: its reasons are in ``batch.errors`` (validation_errors)."""
    rows = session.scalars(select(Request).where(Request.batch_id == batch.id, Request.status == RequestStatus.FAILED)
                           .order_by(Request.line).limit(limit))
    return [ErrorLine(row.line, row.custom_id, error_code_of(row), _message(row), result_line(row)[1].decode().rstrip())
            for row in rows]


def validation_errors(batch: Batch, limit: int = 5) -> list[dict]:
    """The first reasons a batch failed validation (``errors.data``: code, message, line, param)."""
    data = (batch.errors or {}).get("data") or []
    return [entry for entry in data[:limit] if isinstance(entry, dict)]

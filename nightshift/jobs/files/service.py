"""Files as the API sees them: lookup within a project, cursor listing, soft delete, content."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Iterator, Optional

from sqlalchemy import select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.errors import InvalidInput, NotFound
from nightshift.jobs.files.models import File
from nightshift.storage.objectstore import ObjectStore


def get_file(session: Session, project_id: str, file_id: str, param: Optional[str] = None) -> File:
    row = session.get(File, file_id)
    if row is None or row.project_id != project_id or row.deleted_at is not None:
        raise NotFound("file", file_id, param)
    return row


def check_not_expired(row: File, param: str, now: Optional[float] = None) -> None:
    """InvalidInput (``file_expired``) if the file's expiry time has passed."""
    now = time.time() if now is None else now
    if row.expires_at is not None and row.expires_at <= now:
        when = datetime.fromtimestamp(row.expires_at, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        raise InvalidInput(f"File '{row.id}' expired at {when}; upload it again.", param, "file_expired")


def list_files(session: Session, project_id: str, *, after: Optional[str] = None, limit: int = 10_000,
               order: str = "desc", purpose: Optional[str] = None) -> tuple[list[File], bool]:
    """One page of the project's files by created_at (then id); ``after`` is the last id seen."""
    query = select(File).where(File.project_id == project_id, File.deleted_at.is_(None))
    if purpose:
        query = query.where(File.purpose == purpose)
    key = tuple_(File.created_at, File.id)
    if after:
        cursor = get_file(session, project_id, after, "after")
        mark = tuple_(cursor.created_at, cursor.id)
        query = query.where(key < mark if order == "desc" else key > mark)
    sort = (File.created_at.desc(), File.id.desc()) if order == "desc" else (File.created_at, File.id)
    rows = list(session.scalars(query.order_by(*sort).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, project_id: str, file_id: str) -> File:
    """Hide the row (kept because batches refer to it); the caller commits, then calls
    ``delete_content`` so that content never disappears under a row that still shows."""
    row = get_file(session, project_id, file_id)
    row.deleted_at = time.time()
    session.flush()
    return row


def delete_content(store: ObjectStore, row: File) -> None:
    store.delete(row.object_key)


def file_content(store: ObjectStore, row: File) -> Iterator[bytes]:
    try:
        return store.get_stream(row.object_key)
    except KeyError:
        raise NotFound("file", row.id) from None


def upsert_result_file(session: Session, *, file_id: str, project_id: str, filename: str, object_key: str,
                       size: int, now: float, lines: Optional[int] = None,
                       expires_at: Optional[float] = None) -> None:
    """Register a file the service wrote for a project (batch output, errors, cost report) under
    a derived id: one INSERT ... ON CONFLICT, so two finalizes at once (a retried message racing
    the first) both succeed and leave one row describing the object."""
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(File).values(id=file_id, project_id=project_id, filename=filename, purpose="batch_output",
                               bytes=size, object_key=object_key, status="processed", line_count=lines,
                               created_at=now, expires_at=expires_at)
    session.execute(stmt.on_conflict_do_update(index_elements=["id"], set_={
        "bytes": size, "object_key": object_key, "line_count": lines, "deleted_at": None, "expires_at": expires_at}))


def files_by_id(session: Session, project_id: str, file_ids: list[str]) -> dict[str, File]:
    """The project's files among ``file_ids`` that still exist (deleted or unknown ones left out)."""
    if not file_ids:
        return {}
    rows = session.scalars(select(File).where(File.id.in_(file_ids), File.project_id == project_id,
                                              File.deleted_at.is_(None)))
    return {row.id: row for row in rows}

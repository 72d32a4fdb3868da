"""Files: upload (streamed to the object store, counted and size-checked on the way),
lookup within a project, cursor listing, soft delete, content streaming."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from nightshift.jobs.errors import InvalidInput, NotFound
from nightshift.jobs.ids import new_id
from nightshift.jobs.models import File
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore

BATCH_FILE_TTL_SECONDS = 30 * 24 * 3600   # OpenAI: purpose=batch files expire after 30 days
UPLOAD_PURPOSES = ("batch",)


class _LimitedCounter:
    """Reads through to ``raw`` counting bytes and lines; stops the upload once over a limit."""

    def __init__(self, raw: BinaryIO, max_bytes: int, max_lines: int):
        self.raw = raw
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.bytes = 0
        self.newlines = 0
        self.last_byte = b""

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.bytes += len(data)
            self.newlines += data.count(b"\n")
            self.last_byte = data[-1:]
            if self.bytes > self.max_bytes:
                raise InvalidInput(f"File is larger than the limit of {self.max_bytes} bytes.",
                                   "file", "file_too_large")
            if self.newlines > self.max_lines:
                raise InvalidInput(f"File has more than the limit of {self.max_lines} lines.",
                                   "file", "too_many_lines")
        return data

    @property
    def lines(self) -> int:
        return self.newlines + (1 if self.last_byte not in (b"", b"\n") else 0)


def object_key(file_id: str) -> str:
    return f"files/{file_id}"


@dataclass(frozen=True)
class StoredUpload:
    """An upload's bytes in the object store, counted; not yet a file row."""

    file_id: str
    object_key: str
    filename: str
    purpose: str
    bytes: int
    lines: int


def store_upload(store: ObjectStore, settings: Settings, *, filename: str, purpose: str,
                 source: BinaryIO) -> StoredUpload:
    """Check the upload's name and purpose, then stream ``source`` into the store, counting bytes
    and lines against the limits (the object is removed again if anything fails). Needs no
    database: the API calls it without holding a connection."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidInput(f"Invalid value: '{purpose}'. Supported values are: 'batch'.", "purpose",
                           "invalid_value")
    if not filename.endswith(".jsonl"):
        raise InvalidInput("Invalid file format for Batch API. Must be .jsonl", "file", "invalid_file_format")
    file_id = new_id("file-")
    key = object_key(file_id)
    counter = _LimitedCounter(source, settings.max_file_bytes, settings.max_lines)
    try:
        store.put_stream(key, counter)
        if counter.lines == 0:
            raise InvalidInput("The file is empty.", "file", "empty_file")
    except BaseException:
        store.delete(key)
        raise
    return StoredUpload(file_id, key, filename, purpose, counter.bytes, counter.lines)


def record_file(session: Session, project_id: str, upload: StoredUpload,
                expires_after_seconds: Optional[int] = None) -> File:
    """Add the file row of a stored upload (flushed; the caller commits, or deletes the object
    if the transaction fails)."""
    created = time.time()
    ttl = expires_after_seconds if expires_after_seconds is not None else BATCH_FILE_TTL_SECONDS
    row = File(id=upload.file_id, project_id=project_id, filename=upload.filename, purpose=upload.purpose,
               bytes=upload.bytes, object_key=upload.object_key, status="processed", line_count=upload.lines,
               created_at=created, expires_at=created + ttl)
    session.add(row)
    session.flush()
    return row


def create_file(session: Session, store: ObjectStore, settings: Settings, *, project_id: str,
                filename: str, purpose: str, source: BinaryIO,
                expires_after_seconds: Optional[int] = None) -> File:
    """``store_upload`` then ``record_file`` in the caller's session."""
    upload = store_upload(store, settings, filename=filename, purpose=purpose, source=source)
    try:
        return record_file(session, project_id, upload, expires_after_seconds)
    except BaseException:
        store.delete(upload.object_key)
        raise


def get_file(session: Session, project_id: str, file_id: str, param: Optional[str] = None) -> File:
    row = session.get(File, file_id)
    if row is None or row.project_id != project_id or row.deleted_at is not None:
        raise NotFound("file", file_id, param)
    return row


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

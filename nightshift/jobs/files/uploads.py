"""Uploads: stream the bytes into the object store (counted and size-checked on the way),
then add the file row in the caller's transaction. An upload whose process dies between the two
leaves an object no row names (``unrecorded_keys``), which the upkeep sweep removes."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import BinaryIO, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from nightshift.jobs.errors import InvalidInput
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.storable import unstorable_text
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore

BATCH_FILE_TTL_SECONDS = 30 * 24 * 3600   # OpenAI: purpose=batch files expire after 30 days
MAX_FILENAME_CHARS = 512                  # the files.filename column
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
        self.blank = True    # nothing but whitespace so far

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if data:
            self.bytes += len(data)
            self.newlines += data.count(b"\n")
            self.last_byte = data[-1:]
            self.blank = self.blank and not data.strip()
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


UPLOAD_PREFIX = "files/"                  # every upload's object key starts with this


def object_key(file_id: str) -> str:
    return f"{UPLOAD_PREFIX}{file_id}"


def unrecorded_keys(session: Session, keys: list[str]) -> list[str]:
    """Of these upload object keys, those that no file row names (deleted rows still name theirs)."""
    recorded = set(session.scalars(select(File.object_key).where(File.object_key.in_(keys))))
    return [key for key in keys if key not in recorded]


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
                 source: BinaryIO, max_bytes: Optional[int] = None, max_lines: Optional[int] = None) -> StoredUpload:
    """Check the upload's name and purpose, then stream ``source`` into the store, counting bytes
    and lines against the limits (the object is removed again if anything fails). A file of
    nothing but whitespace is refused as empty, as a 0-byte one is. Needs no database: the API
    calls it without holding a connection. ``max_bytes``, ``max_lines``: other limits than the
    settings' upload limits (a message batch's input file has Anthropic's)."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidInput(f"Invalid value: '{purpose}'. Supported values are: 'batch'.", "purpose",
                           "invalid_value")
    if unstorable_text(filename) or len(filename) > MAX_FILENAME_CHARS:
        why = unstorable_text(filename) or f"is longer than {MAX_FILENAME_CHARS} characters"
        raise InvalidInput(f"Invalid file name: it {why}.", "file", "invalid_value")
    if not filename.endswith(".jsonl"):
        raise InvalidInput("Invalid file format for Batch API. Must be .jsonl", "file", "invalid_file_format")
    file_id = new_id("file-")
    key = object_key(file_id)
    counter = _LimitedCounter(source, max_bytes or settings.max_file_bytes, max_lines or settings.max_lines)
    try:
        store.put_stream(key, counter)
        if counter.blank:   # 0 bytes, or whitespace only: no line to run either way
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

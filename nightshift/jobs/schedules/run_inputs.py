"""A schedule run's input: read the schedule's source (documents under a prefix, JSONL
objects under a prefix, or a stored JSONL file), hash every document, and write the changed
ones as batch input lines."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass

import orjson
from sqlalchemy import select
from sqlalchemy.orm import Session

from nightshift.jobs.files.models import File
from nightshift.jobs.schedules.models import IndexedDocument, Schedule
from nightshift.jobs.schedules.reindex import (TemplateRenderError, content_hash, render_body, request_line,
                                               select_changed)
from nightshift.settings import Settings
from nightshift.storage.listing import list_keys
from nightshift.storage.objectstore import ObjectStore, iter_lines


class RunInputError(ValueError):
    """The run's source cannot be turned into requests (named document or line)."""


@dataclass
class RunInput:
    current: dict[str, str]        # document key -> sha256, every document of the source
    changed: dict[str, str]        # the subset sent in this run
    spool: tempfile.SpooledTemporaryFile
    removed: list[str]


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


def collect_input(session: Session, schedule: Schedule, store: ObjectStore, settings: Settings) -> RunInput:
    """Every document of the schedule's source with its hash, and the changed ones written
    as batch input lines to a spool file (read from the start)."""
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
    return RunInput(current, {k: current[k] for k in selection.changed}, spool, selection.removed)

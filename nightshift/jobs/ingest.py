"""Ingest of a batch's input file: stream + validate every line, tokenize prompts with the
model's chat template, plan prefix-grouped shards, and bulk-insert one request row per line
(COPY on Postgres, executemany on SQLite) in the same transaction that moves the batch to
``in_progress``. Re-running it for a batch no longer ``validating`` does nothing, so a
duplicated Celery message is harmless."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from nightshift.jobs.chat_prompts import ChatPromptRenderer, SegmentEncoder
from nightshift.jobs.models import REQUEST_COPY_COLUMNS, Batch, BatchStatus, File, Request, RequestStatus, Shard
from nightshift.jobs.openai_mapping import (CHAT, RequestBodyError, chat_messages, planned_max_tokens, prompt_token_ids,
                                 requested_max_tokens)
from nightshift.settings import Settings, get_settings
from nightshift.jobs.sharding import plan_shards
from nightshift.jobs.validation import ValidationResult, validate_lines
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore, get_object_store, iter_lines

log = logging.getLogger(__name__)


@dataclass
class IngestOutcome:
    status: str                                  # batch status after ingest
    shard_ids: list[int] = field(default_factory=list)
    request_count: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def _fail(session: Session, batch_id: str, errors: dict[str, Any]) -> bool:
    res = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
                          .values(status=BatchStatus.FAILED, failed_at=time.time(), errors=errors))
    return res.rowcount == 1


def _copy_requests(session: Session, rows: list[tuple]) -> None:
    """COPY into requests on Postgres; executemany elsewhere."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        raw = conn.connection.driver_connection
        cols = ", ".join(REQUEST_COPY_COLUMNS)
        with raw.cursor() as cur, cur.copy(f"COPY requests ({cols}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    else:
        dicts = [dict(zip(REQUEST_COPY_COLUMNS, row)) for row in rows]
        for d in dicts:  # the JSON columns were pre-serialised for COPY
            d["body"] = orjson.loads(d["body"])
            d["prompt_token_ids"] = orjson.loads(d["prompt_token_ids"])
        session.execute(insert(Request), dicts)


def _stored_max_tokens(body: dict[str, Any]) -> Optional[int]:
    try:
        value = requested_max_tokens(body)
    except RequestBodyError:
        return None
    return value if value is not None and -2**31 < value < 2**31 else None


def tokenize_lines(result: ValidationResult, endpoint: str, tokenizer, settings: Settings) -> list[list[int]]:  # noqa: ANN001
    """Prompt token ids per valid line; a line whose prompt cannot be built becomes a validation error.

    Chat prompts are rendered with the model's template, then encoded in batches (the same ids
    as ``apply_chat_template``, which is render + encode without special tokens)."""
    token_ids: list[list[int]] = [[] for _ in result.lines]
    batched = endpoint == CHAT and hasattr(tokenizer, "render_chat") and hasattr(tokenizer, "backend")
    renderer = ChatPromptRenderer(tokenizer) if batched else None
    encoder = SegmentEncoder(tokenizer) if batched else None
    pending: list[tuple[int, str]] = []

    def encode_pending() -> None:
        for (i, _), ids in zip(pending, encoder.encode_many([t for _, t in pending])):
            token_ids[i] = ids
        pending.clear()

    for i, vl in enumerate(result.lines):
        try:
            if batched:
                pending.append((i, renderer.render(chat_messages(vl.body))))
                if len(pending) >= 2048:
                    encode_pending()
            else:
                token_ids[i] = prompt_token_ids(vl.body, endpoint, tokenizer)
        except RequestBodyError as e:
            result.add_error(e.code, e.message, f"body.{e.param}" if e.param else "body", vl.line)
        except Exception as e:  # the chat template itself refused these messages
            result.add_error("invalid_request", f"The messages could not be formatted with the model's chat "
                             f"template: {e}", "body.messages", vl.line)
    encode_pending()
    total = sum(len(t) for t in token_ids)
    if total > settings.max_batch_tokens:
        result.add_error("token_limit_exceeded", f"The batch has {total} prompt tokens; the limit is "
                         f"{settings.max_batch_tokens}.", None, None)
    return token_ids


def ingest_batch(batch_id: str, tokenizer, *, store: Optional[ObjectStore] = None,  # noqa: ANN001
                 settings: Optional[Settings] = None, db_url: Optional[str] = None) -> IngestOutcome:
    settings = settings or get_settings()
    store = store or get_object_store()
    t0 = time.perf_counter()
    with session_scope(db_url) as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            raise LookupError(f"no batch {batch_id!r}")
        if batch.status != BatchStatus.VALIDATING:
            return IngestOutcome(batch.status)
        file = s.get(File, batch.input_file_id)
        endpoint = batch.endpoint
        object_key = file.object_key if file is not None and file.deleted_at is None else None
    result = ValidationResult()
    if object_key is None or not store.exists(object_key):
        result.add_error("invalid_request", f"Cannot find file {batch.input_file_id}.", "input_file_id", None)
    else:
        result = validate_lines(iter_lines(store.get_stream(object_key)), endpoint, settings.accepted_model_names(),
                                max_lines=settings.max_lines, max_bytes=settings.max_file_bytes)
    t_validate = time.perf_counter()
    token_ids: list[list[int]] = []
    if result.ok:
        token_ids = tokenize_lines(result, endpoint, tokenizer, settings)
    t_tokenize = time.perf_counter()
    if not result.ok:
        with session_scope(db_url) as s:
            _fail(s, batch_id, result.errors_object())
            status = s.get(Batch, batch_id).status
        return IngestOutcome(status, seconds={"validate": t_validate - t0})

    max_tokens = [planned_max_tokens(vl.body, endpoint, settings.default_chat_max_tokens,
                                     settings.default_completion_max_tokens) for vl in result.lines]
    plan = plan_shards(token_ids, max_tokens, settings.shard_token_budget)
    t_plan = time.perf_counter()
    now = time.time()
    with session_scope(db_url) as s:
        # Take the batch row first: a concurrent duplicate ingest or a cancel waits here.
        locked = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
                           .values(status=BatchStatus.VALIDATING))
        if locked.rowcount != 1:
            return IngestOutcome(s.get(Batch, batch_id).status)
        shard_rows = [{"batch_id": batch_id, "seq": p.seq, "status": "pending", "num_requests": len(p.members),
                       "planned_tokens": p.planned_tokens, "enqueued_at": now} for p in plan]
        shard_ids = list(s.execute(insert(Shard).returning(Shard.id, sort_by_parameter_order=True),
                                   shard_rows).scalars())
        rows = []
        for p, shard_id in zip(plan, shard_ids):
            for i in p.members:  # insertion order = prefix order, so ids follow the run order
                vl = result.lines[i]
                body = vl.body
                rows.append((batch_id, shard_id, vl.line, vl.custom_id, orjson.dumps(body).decode(),
                             orjson.dumps(token_ids[i]).decode(), _stored_max_tokens(body),
                             RequestStatus.PENDING, len(token_ids[i]), 0, 0, 0.0, now))
        _copy_requests(s, rows)
        s.execute(update(Batch).where(Batch.id == batch_id).values(
            status=BatchStatus.IN_PROGRESS, in_progress_at=now, model=result.model, request_total=len(rows),
            planned_prompt_tokens=sum(len(t) for t in token_ids), planned_max_tokens=sum(max_tokens),
            last_enqueued_at=now))
    t_insert = time.perf_counter()
    log.info("ingested batch %s: %d requests, %d shards", batch_id, len(rows), len(shard_ids))
    return IngestOutcome(BatchStatus.IN_PROGRESS, shard_ids, len(rows),
                         {"validate": t_validate - t0, "tokenize": t_tokenize - t_validate,
                          "plan": t_plan - t_tokenize, "insert": t_insert - t_plan, "total": t_insert - t0})

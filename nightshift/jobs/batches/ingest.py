"""Ingest of a batch's input file, as steps the worker runs in order (each database step in
its own transaction, owned by ``nightshift.workers.ingest``):

1. ``start_ingest``: count the attempt (committed before the work, so an attempt that dies
   still counts: past ``max_ingest_attempts`` the batch fails instead of looping) and read
   what to ingest, if the batch is still ``validating``; ``keep_ingest_alive`` while it runs;
2. ``validate_input`` + ``tokenize_lines``: stream and check every line, then tokenize the
   prompts with the model's chat template (no database);
3. ``fail_ingest`` with the line errors (or ``ingest_failed_errors`` when ingest itself kept
   failing), or ``plan_ingest`` (prefix-grouped shards) and
   ``insert_requests``: one request row per line (COPY on Postgres, executemany on SQLite)
   in the same transaction that moves the batch to ``in_progress``.

Both writes are conditional on ``validating``, so a duplicated Celery message or a cancel
that came first leaves the batch as it is.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import orjson
from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from nightshift.jobs.batches import embeddings
from nightshift.jobs.batches.documents import batch_document
from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard
from nightshift.jobs.batches.openai_mapping import (CHAT, EMBEDDINGS, MESSAGES, RequestBodyError, chat_prompt,
                                                    planned_max_tokens, prompt_token_ids, requested_max_tokens)
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.batches.shard_planning import PlannedShard, plan_shards
from nightshift.jobs.batches.validation import ValidationResult, validate_lines
from nightshift.jobs.engine_hosts import registry
from nightshift.jobs.files.models import File
from nightshift.jobs.webhooks.events import record_event
from nightshift.settings import Settings
from nightshift.storage.objectstore import ObjectStore, iter_lines

# The order of the values in each row given to insert_requests' COPY.
REQUEST_COPY_COLUMNS = ("batch_id", "shard_id", "line", "custom_id", "body", "prompt_token_ids",
                        "max_tokens", "status", "prompt_tokens", "cached_tokens", "completion_tokens",
                        "engine_seconds", "queued_at")
ENCODE_CHUNK = 2048   # chat prompts rendered, then encoded this many at a time


@dataclass(frozen=True)
class IngestSource:
    """The batch as ingest reads it. ``status`` other than validating: nothing to ingest."""

    status: str
    endpoint: str
    input_file_id: str
    object_key: Optional[str]            # None when the input file is gone
    attempt: int = 0                     # ingest attempts so far, this one included


@dataclass
class IngestPlan:
    lines: ValidationResult
    token_ids: list[list[int]]           # per valid line
    max_tokens: list[int]                # per valid line, as planned
    shards: list[PlannedShard]
    # per valid line, where the prompt is not tokenized at ingest (embeddings: an estimate;
    # the engine worker tokenizes); None: len(token_ids[i])
    prompt_tokens: Optional[list[int]] = None

    def prompt_length(self, i: int) -> int:
        return self.prompt_tokens[i] if self.prompt_tokens is not None else len(self.token_ids[i])


def ingest_source(s: Session, batch_id: str) -> IngestSource:
    batch = s.get(Batch, batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id!r}")
    file = s.get(File, batch.input_file_id)
    object_key = file.object_key if file is not None and file.deleted_at is None else None
    return IngestSource(batch.status, batch.endpoint, batch.input_file_id, object_key, batch.ingest_attempts)


def start_ingest(s: Session, batch_id: str, now: float) -> IngestSource:
    """Count one more ingest attempt of a validating batch and mark it alive (the reconciler
    re-sends an ingest only after ``last_enqueued_at`` has gone stale); then what to read.
    The caller commits this before the work starts."""
    s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
              .values(ingest_attempts=Batch.ingest_attempts + 1, last_enqueued_at=now))
    return ingest_source(s, batch_id)


def refund_ingest_attempt(s: Session, batch_id: str) -> None:
    """Un-count an attempt that an outage (not the batch) interrupted."""
    s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING,
                                  Batch.ingest_attempts > 0)
              .values(ingest_attempts=Batch.ingest_attempts - 1))


def keep_ingest_alive(s: Session, batch_id: str, now: float) -> None:
    """A running ingest's heartbeat: no second ingest is sent beside a live one (and counted)."""
    s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
              .values(last_enqueued_at=now))


def ingest_failed_errors(attempts: int, reason: Optional[str]) -> dict[str, Any]:
    """The batch's ``errors`` when ingest itself kept failing (not the file's lines): how many
    times, and the last error's class and message (no traceback)."""
    why = f"The last attempt failed with {reason}" if reason else \
        "The last attempt stopped without reporting an error (its worker may have been killed or run out of memory)"
    message = f"Ingest of the input file failed {attempts} times, so the batch was failed. {why}."
    return {"object": "list", "data": [{"code": "ingest_failed", "message": message.replace("\x00", "\\u0000"),
                                        "param": None, "line": None}]}


def accepted_models(s: Session, endpoint: str, settings: Settings, now: float) -> set[str]:
    """The model names a line of ``endpoint`` may use: those the live engine workers serve
    (jobs/engine_hosts), or where none is alive yet (a cold start), this process's settings'."""
    kind = registry.EMBEDDINGS if endpoint == EMBEDDINGS else registry.CHAT
    served = registry.served_names(s, kind, now, settings.engine_host_stale_seconds)
    if served is not None:
        return served
    return settings.accepted_embedding_model_names() if endpoint == EMBEDDINGS else settings.accepted_model_names()


def validate_input(store: ObjectStore, source: IngestSource, settings: Settings,
                   models: Optional[set[str]] = None) -> ValidationResult:
    """Every line checked; ``models``: the names a line's model may be (``accepted_models``;
    default: the settings')."""
    if source.object_key is None or not store.exists(source.object_key):
        result = ValidationResult()
        result.add_error("invalid_request", f"Cannot find file {source.input_file_id}.", "input_file_id", None)
        return result
    if models is None:
        models = settings.accepted_embedding_model_names() if source.endpoint == EMBEDDINGS \
            else settings.accepted_model_names()
    max_lines, max_bytes = ((settings.max_message_batch_requests, message_batch_file_bytes(settings))
                            if source.endpoint == MESSAGES else (settings.max_lines, settings.max_file_bytes))
    return validate_lines(iter_lines(store.get_stream(source.object_key)), source.endpoint, models,
                          max_lines=max_lines, max_bytes=max_bytes)


def message_batch_file_bytes(settings: Settings) -> int:
    """The largest input file of a message batch: its create body's limit plus the bytes each line
    adds around the params (``{"custom_id":…,"method":"POST","url":"/v1/messages","body":…}``)."""
    return settings.max_message_batch_bytes + 128 * settings.max_message_batch_requests


def tokenize_lines(result: ValidationResult, endpoint: str, tokenizer,  # noqa: ANN001
                   settings: Settings) -> list[list[int]]:
    """Prompt token ids per valid line; a line whose prompt cannot be built becomes a validation error.

    Chat prompts are rendered with the model's template (with the body's tools: chat_history.py),
    then encoded in batches (the same ids as ``apply_chat_template``, which is render + encode
    without special tokens). Embeddings
    lines are not tokenized here (the embedding model's tokenizer runs in the engine worker):
    their ids are empty and the token limit is checked on their estimate."""
    token_ids: list[list[int]] = [[] for _ in result.lines]
    if endpoint == EMBEDDINGS:
        _check_token_limit(sum(embeddings.planned_tokens(vl.body) for vl in result.lines), result, settings)
        return token_ids
    batched = endpoint == CHAT and hasattr(tokenizer, "chat_prompt_encoder")
    encoder = tokenizer.chat_prompt_encoder() if batched else None
    tool_support = getattr(tokenizer, "tool_support", None)
    pending: list[tuple[int, str]] = []

    def encode_pending() -> None:
        for (i, _), ids in zip(pending, encoder.encode_many([t for _, t in pending])):
            token_ids[i] = ids
        pending.clear()

    for i, vl in enumerate(result.lines):
        try:
            if batched:
                pending.append((i, encoder.render(*chat_prompt(vl.body, tool_support))))
                if len(pending) >= ENCODE_CHUNK:
                    encode_pending()
            else:
                token_ids[i] = prompt_token_ids(vl.body, endpoint, tokenizer)
        except RequestBodyError as e:
            if endpoint == MESSAGES:
                continue        # that request errs on its own when its shard loads (anthropic_messages.py)
            result.add_error(e.code, e.message, f"body.{e.param}" if e.param else "body", vl.line)
        except Exception as e:  # the chat template itself refused these messages
            if endpoint == MESSAGES:
                continue
            result.add_error("invalid_request", f"The messages could not be formatted with the model's chat "
                             f"template: {e}", "body.messages", vl.line)
    if pending:
        encode_pending()
    _check_token_limit(sum(len(t) for t in token_ids), result, settings)
    return token_ids


def _check_token_limit(total: int, result: ValidationResult, settings: Settings) -> None:
    if total > settings.max_batch_tokens:
        result.add_error("token_limit_exceeded", f"The batch has {total} prompt tokens; the limit is "
                         f"{settings.max_batch_tokens}.", None, None)


def fail_ingest(s: Session, batch_id: str, errors: dict[str, Any]) -> bool:
    """validating -> failed with the line errors (and the ``batch.failed`` webhook event, in the
    same transaction); False if the batch had left validating."""
    now = time.time()
    res = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
                    .values(status=BatchStatus.FAILED, failed_at=now, errors=errors))
    if res.rowcount != 1:
        return False
    batch = s.get(Batch, batch_id, populate_existing=True)
    document = batch_document(batch, batch_progress(s, [batch])[batch_id])
    record_event(s, batch.project_id, "batch.failed", batch_id, document, now)
    return True


def plan_ingest(lines: ValidationResult, token_ids: list[list[int]], endpoint: str,
                settings: Settings) -> IngestPlan:
    if endpoint == EMBEDDINGS:   # in file order, cut by estimated tokens (no prompt prefixes to group)
        estimates = [embeddings.planned_tokens(vl.body) for vl in lines.lines]
        shards = plan_shards(token_ids, estimates, settings.shard_token_budget, settings.shard_max_requests,
                             min_shards=settings.shard_min_count, min_requests=settings.shard_min_requests)
        return IngestPlan(lines, token_ids, [0] * len(estimates), shards, estimates)
    max_tokens = [planned_max_tokens(vl.body, endpoint, settings.default_chat_max_tokens,
                                     settings.default_completion_max_tokens) for vl in lines.lines]
    shards = plan_shards(token_ids, max_tokens, settings.shard_token_budget, settings.shard_max_requests,
                         min_shards=settings.shard_min_count, min_requests=settings.shard_min_requests)
    return IngestPlan(lines, token_ids, max_tokens, shards)


def insert_requests(s: Session, batch_id: str, plan: IngestPlan, now: float) -> Optional[list[int]]:
    """The shards and request rows of a validating batch, which moves to in_progress; returns
    the new shard ids, or None (nothing written) if the batch had left validating."""
    # Take the batch row first: a concurrent duplicate ingest or a cancel waits here.
    locked = s.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
                       .values(status=BatchStatus.VALIDATING))
    if locked.rowcount != 1:
        return None
    shard_rows = [{"batch_id": batch_id, "seq": p.seq, "status": "pending", "num_requests": len(p.members),
                   "planned_tokens": p.planned_tokens, "enqueued_at": now} for p in plan.shards]
    shard_ids = list(s.execute(insert(Shard).returning(Shard.id, sort_by_parameter_order=True),
                               shard_rows).scalars())
    rows = []
    for p, shard_id in zip(plan.shards, shard_ids):
        for i in p.members:  # insertion order = prefix order, so ids follow the run order
            vl = plan.lines.lines[i]
            rows.append((batch_id, shard_id, vl.line, vl.custom_id, orjson.dumps(vl.body).decode(),
                         orjson.dumps(plan.token_ids[i]).decode(), _stored_max_tokens(vl.body),
                         RequestStatus.PENDING, plan.prompt_length(i), 0, 0, 0.0, now))
    _copy_requests(s, rows)
    s.execute(update(Batch).where(Batch.id == batch_id).values(
        status=BatchStatus.IN_PROGRESS, in_progress_at=now, model=plan.lines.model, request_total=len(rows),
        planned_prompt_tokens=sum(map(plan.prompt_length, range(len(plan.token_ids)))),
        planned_max_tokens=sum(plan.max_tokens),
        last_enqueued_at=now))
    return shard_ids


def _copy_requests(s: Session, rows: list[tuple]) -> None:
    """COPY into requests on Postgres; executemany elsewhere."""
    conn = s.connection()
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
        s.execute(insert(Request), dicts)


def _stored_max_tokens(body: dict[str, Any]) -> Optional[int]:
    try:
        value = requested_max_tokens(body)
    except RequestBodyError:
        return None
    return value if value is not None and -2**31 < value < 2**31 else None

"""Ingest a batch in stages, each database step in its own transaction, so no transaction
(and on SQLite no write lock) is held while the file streams, validates and tokenizes:

1. count the attempt and read what to ingest (nothing if the batch is no longer
   ``validating``), committed at once; while the attempt runs, a heartbeat keeps the batch's
   ``last_enqueued_at`` fresh, so the reconciler sends no second ingest beside a live one;
2. validate + tokenize + plan, with no transaction open;
3. one transaction: fail the batch with its line errors, or insert the shards and request
   rows and move it to ``in_progress``. That write is conditional on ``validating``, so a
   duplicated message or a cancel in between is harmless.
The shard wake-ups are sent by the task after step 3 has committed.

An attempt that raises is retried (the task fails; the reconciler sends the ingest again),
but only ``max_ingest_attempts`` times: the last one to fail, or the first to start past the
limit (the earlier ones died without a word), fails the batch with an ``ingest_failed`` error
naming the last exception, so a file that breaks ingest for good never loops.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from nightshift.jobs.batches.ingest import (IngestSource, accepted_models, fail_ingest, ingest_failed_errors,
                                            insert_requests, keep_ingest_alive, plan_ingest, refund_ingest_attempt,
                                            start_ingest, tokenize_lines, validate_input)
from nightshift.jobs.batches.lifecycle import batch_status
from nightshift.jobs.batches.models import BatchStatus
from nightshift.jobs.batches.openai_mapping import EMBEDDINGS
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class IngestOutcome:
    status: str                                  # batch status after ingest
    shard_ids: list[int] = field(default_factory=list)
    request_count: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def ingest_batch(batch_id: str, tokenizer=None, *, settings: Settings, store: ObjectStore,  # noqa: ANN001
                 load_tokenizer: Optional[Callable[[], object]] = None) -> IngestOutcome:
    """Ingest one batch. ``tokenizer``, or ``load_tokenizer()`` called only once the file is
    valid (so a tokenizer that cannot load counts as a failed attempt, and a bad file needs none)."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        source = start_ingest(s, batch_id, now=time.time())
    if source.status != BatchStatus.VALIDATING:
        return IngestOutcome(source.status)
    limit = settings.max_ingest_attempts
    if source.attempt > limit:
        log.error("ingest of batch %s: %d attempts stopped without finishing; failing the batch",
                  batch_id, source.attempt - 1)
        return _give_up(url, batch_id, source.attempt - 1, None)
    heartbeat = _Heartbeat(url, batch_id, max(0.5, min(settings.heartbeat_seconds,
                                                       settings.requeue_pending_after_seconds / 4)))
    try:
        return _ingest(batch_id, source, tokenizer, load_tokenizer, settings, store)
    except Exception as exc:  # noqa: BLE001 - whatever broke this attempt
        reason = describe_failure(exc)
        if is_transient(exc):
            # The object store or the database was unreachable: not the batch's fault, and an
            # outage of any length must not use up its attempts. The reconciler sends it again.
            log.warning("ingest of batch %s hit an outage (not counted as an attempt; it will be retried): %s",
                        batch_id, reason)
            _refund_attempt(url, batch_id)
            raise
        if source.attempt < limit:
            log.warning("ingest of batch %s failed (attempt %d of %d; it will be retried): %s", batch_id,
                        source.attempt, limit, reason)
            raise
        log.error("ingest of batch %s failed %d times; failing the batch: %s", batch_id, source.attempt, reason)
        return _give_up(url, batch_id, source.attempt, reason)
    finally:
        heartbeat.stop()


def _ingest(batch_id: str, source: IngestSource, tokenizer, load_tokenizer,  # noqa: ANN001
            settings: Settings, store: ObjectStore) -> IngestOutcome:
    url = settings.resolved_database_url
    t0 = time.perf_counter()
    with session_scope(url) as s:
        models = accepted_models(s, source.endpoint, settings, time.time())
    lines = validate_input(store, source, settings, models)
    t_validate = time.perf_counter()
    if lines.ok:
        if tokenizer is None and source.endpoint != EMBEDDINGS:   # the embedding worker tokenizes those
            tokenizer = load_tokenizer()
        token_ids = tokenize_lines(lines, source.endpoint, tokenizer, settings)
    else:
        token_ids = []
    t_tokenize = time.perf_counter()
    if not lines.ok:
        with session_scope(url) as s:
            fail_ingest(s, batch_id, lines.errors_object())
            status = batch_status(s, batch_id)
        return IngestOutcome(status, seconds={"validate": t_validate - t0})

    plan = plan_ingest(lines, token_ids, source.endpoint, settings)
    t_plan = time.perf_counter()
    with session_scope(url) as s:
        shard_ids = insert_requests(s, batch_id, plan, now=time.time())
        if shard_ids is None:
            return IngestOutcome(batch_status(s, batch_id))
    t_insert = time.perf_counter()
    count = len(lines.lines)
    log.info("ingested batch %s: %d requests, %d shards", batch_id, count, len(shard_ids))
    return IngestOutcome(BatchStatus.IN_PROGRESS, shard_ids, count,
                         {"validate": t_validate - t0, "tokenize": t_tokenize - t_validate,
                          "plan": t_plan - t_tokenize, "insert": t_insert - t_plan, "total": t_insert - t0})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is an outage of a service ingest talks to (the object store or the
    database unreachable, timing out or asking to slow down), which a later attempt can outlive,
    rather than something about this batch."""
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError
    from sqlalchemy.exc import DBAPIError, OperationalError

    if isinstance(exc, (BotoConnectionError, HTTPClientError, OperationalError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or exc.response.get("Error", {}).get("Code") in ("SlowDown", "RequestTimeout",
                                                                               "Throttling", "ServiceUnavailable")
    return False


def _refund_attempt(url: str, batch_id: str) -> None:
    try:
        with session_scope(url) as s:
            refund_ingest_attempt(s, batch_id)
    except Exception:  # noqa: BLE001 - the database itself may be what is down: then the attempt counts
        log.warning("ingest of batch %s: could not un-count the interrupted attempt", batch_id, exc_info=True)


def _give_up(url: str, batch_id: str, attempts: int, reason: Optional[str]) -> IngestOutcome:
    with session_scope(url) as s:
        fail_ingest(s, batch_id, ingest_failed_errors(attempts, reason))
        return IngestOutcome(batch_status(s, batch_id))


def describe_failure(exc: BaseException, limit: int = 300) -> str:
    """``Class: first line of the message`` of an exception (a database error's driver error
    when there is one), short and without a traceback or the statement's parameters."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if len(text) > limit:
        text = text[:limit] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Heartbeat:
    """Bumps the batch's ``last_enqueued_at`` every ``interval`` seconds until stopped."""

    def __init__(self, url: str, batch_id: str, interval: float):
        self.url, self.batch_id, self.interval = url, batch_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"ingest-heartbeat-{batch_id}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with session_scope(self.url) as s:
                    keep_ingest_alive(s, self.batch_id, time.time())
            except Exception:  # noqa: BLE001 - a missed beat only lets the reconciler send a spare ingest
                log.warning("ingest of batch %s: could not renew its heartbeat", self.batch_id, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

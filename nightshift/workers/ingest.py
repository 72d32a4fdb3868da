"""Ingest a batch in stages, each database step in its own transaction, so no transaction
(and on SQLite no write lock) is held while the file streams, validates and tokenizes:

1. read what to ingest (nothing if the batch is no longer ``validating``);
2. validate + tokenize + plan, with no transaction open;
3. one transaction: fail the batch with its line errors, or insert the shards and request
   rows and move it to ``in_progress``. That write is conditional on ``validating``, so a
   duplicated message or a cancel in between is harmless.
The shard wake-ups are sent by the task after step 3 has committed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from nightshift.jobs.batches.ingest import (fail_ingest, ingest_source, insert_requests, plan_ingest,
                                            tokenize_lines, validate_input)
from nightshift.jobs.batches.lifecycle import batch_status
from nightshift.jobs.batches.models import BatchStatus
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


def ingest_batch(batch_id: str, tokenizer, *, settings: Settings, store: ObjectStore) -> IngestOutcome:  # noqa: ANN001
    url = settings.resolved_database_url
    t0 = time.perf_counter()
    with session_scope(url) as s:
        source = ingest_source(s, batch_id)
    if source.status != BatchStatus.VALIDATING:
        return IngestOutcome(source.status)
    lines = validate_input(store, source, settings)
    t_validate = time.perf_counter()
    token_ids = tokenize_lines(lines, source.endpoint, tokenizer, settings) if lines.ok else []
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

"""The promises of a finished batch, checked from the database and the object store (the
same rows and objects the API serves): used by ``bench.chaos`` after every round and by the
service tests (tests/service/test_exactly_once.py, test_faults.py).

- the batch is terminal, and none of its request rows is still pending;
- every custom_id of the input appears exactly once across output.jsonl and errors.jsonl
  (``lost``: not there, ``duplicated``: there more than once, ``unexpected``: not in the input);
- the batch's ``request_counts`` and ``usage`` (what ``GET /v1/batches/{id}`` shows, summed
  over its shard rows) equal the counts and the usage summed over the lines of its files;
- its stored cost report (cost.json) counts every request once, its token totals equal the
  lines' usage, and its dollar and engine-second totals equal the sums of its cost.csv rows.
"""
from __future__ import annotations

import csv
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import orjson
from sqlalchemy import func, select

from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard, ShardStatus
from nightshift.jobs.batches.progress import batch_progress
from nightshift.jobs.costs.batch_costs import cost_file_ids
from nightshift.jobs.files.models import File
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore


@dataclass
class BatchCheck:
    """What ``check_batch`` found for one batch; ``ok`` when every promise holds."""

    batch_id: str
    status: str
    requests: int                      # custom_ids in the input
    lost: int = 0
    duplicated: int = 0
    unexpected: int = 0
    stuck: int = 0                     # request rows still pending
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.problems or self.lost or self.duplicated or self.unexpected or self.stuck)


def _read(store: ObjectStore, db_url: str, file_id: Optional[str]) -> bytes:
    """A file's bytes (none for no file id); KeyError if its row or its object is missing."""
    if not file_id:
        return b""
    with session_scope(db_url) as s:
        row = s.get(File, file_id)
        if row is None:
            raise KeyError(f"no file row {file_id}")
        key = row.object_key
    return b"".join(store.get_stream(key))


def result_lines(store: ObjectStore, db_url: str, batch_id: str) -> tuple[list[dict], list[dict]]:
    """The parsed lines of the batch's output file and error file (empty where there is none)."""
    with session_scope(db_url) as s:
        batch = s.get(Batch, batch_id)
        output_id, error_id = batch.output_file_id, batch.error_file_id
    return ([orjson.loads(x) for x in _read(store, db_url, output_id).splitlines()],
            [orjson.loads(x) for x in _read(store, db_url, error_id).splitlines()])


def all_custom_ids(store: ObjectStore, db_url: str, batch_id: str) -> list[str]:
    """Every custom_id in the output and error files, as often as it appears."""
    output, errors = result_lines(store, db_url, batch_id)
    return [line["custom_id"] for line in output + errors]


def count_ids(expected: Iterable[str], found: Iterable[str]) -> tuple[int, int, int]:
    """(lost, duplicated, unexpected): expected ids absent, extra copies, ids not expected."""
    expected, counts = set(expected), Counter(found)
    return (len(expected - set(counts)), sum(n - 1 for n in counts.values() if n > 1),
            len(set(counts) - expected))


def _line_usage(lines: list[dict]) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens summed over the lines that carry a response usage."""
    prompt = cached = completion = 0
    for line in lines:
        usage = ((line.get("response") or {}).get("body") or {}).get("usage")
        if usage:
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            completion += usage["completion_tokens"]
    return prompt, cached, completion


def check_batch(db_url: str, store: ObjectStore, batch_id: str, expected_ids: Iterable[str]) -> BatchCheck:
    """Check every promise of one batch (see the module docstring)."""
    expected = list(expected_ids)
    with session_scope(db_url) as s:
        batch = s.get(Batch, batch_id)
        progress = batch_progress(s, [batch])[batch_id]
        stuck = s.scalar(select(func.count()).select_from(Request).where(
            Request.batch_id == batch_id, Request.status == RequestStatus.PENDING))
        status = batch.status
    check = BatchCheck(batch_id, status, len(expected), stuck=stuck)
    if status not in BatchStatus.TERMINAL:
        check.problems.append(f"status {status!r} is not terminal")
        return check
    try:
        output, errors = result_lines(store, db_url, batch_id)
    except KeyError as exc:
        check.problems.append(f"a result file is missing: {exc}")
        return check
    check.lost, check.duplicated, check.unexpected = count_ids(expected, [x["custom_id"] for x in output + errors])
    prompt, cached, completion = _line_usage(output + errors)
    shown = (progress.total, progress.completed, progress.failed, progress.input_tokens, progress.cached_tokens,
             progress.output_tokens)
    summed = (len(expected), len(output), len(errors), prompt, cached, completion)
    if shown != summed:
        check.problems.append(f"batch counts/usage (total, completed, failed, input, cached, output) {shown} "
                              f"!= the lines' {summed}")
    check.problems += _cost_problems(store, db_url, batch_id, expected, (prompt, cached, completion))
    return check


def _cost_problems(store: ObjectStore, db_url: str, batch_id: str, expected: list[str],
                   usage: tuple[int, int, int]) -> list[str]:
    json_id, csv_id = cost_file_ids(batch_id)
    try:
        report = orjson.loads(_read(store, db_url, json_id))
        rows = list(csv.DictReader(io.StringIO(_read(store, db_url, csv_id).decode())))
    except KeyError as exc:
        return [f"the cost report is missing: {exc}"]
    problems = []
    lost, duplicated, unexpected = count_ids(expected, [r["custom_id"] for r in rows])
    if report["requests"]["total"] != len(expected) or lost or duplicated or unexpected:
        problems.append(f"cost report counts {report['requests']['total']} requests, cost.csv lost {lost} "
                        f"duplicated {duplicated} unexpected {unexpected} of {len(expected)}")
    tokens = report["tokens"]
    reported = (tokens["prompt_tokens"], tokens["cached_prompt_tokens"], tokens["completion_tokens"])
    if reported != usage:
        problems.append(f"cost report tokens (prompt, cached, completion) {reported} != the lines' {usage}")
    usd = math.fsum(float(r["cost_usd"]) for r in rows)
    seconds = math.fsum(float(r["engine_seconds"]) for r in rows)
    if report["cost"]["usd"] != usd or report["engine_seconds"] != seconds:
        problems.append(f"cost report usd {report['cost']['usd']!r} / engine seconds {report['engine_seconds']!r} "
                        f"!= cost.csv sums {usd!r} / {seconds!r}")
    return problems


@dataclass
class StoreHygiene:
    """Database-wide leftovers: request rows or shards still live in a finished batch, batches
    not finished."""

    stuck_requests: int
    live_shards: int
    unfinished_batches: list[str]

    @property
    def ok(self) -> bool:
        return not (self.stuck_requests or self.live_shards or self.unfinished_batches)


def database_leftovers(db_url: str) -> StoreHygiene:
    """Every batch in the database should be terminal, with no pending request and no pending or
    running shard."""
    with session_scope(db_url) as s:
        finished = select(Batch.id).where(Batch.status.in_(BatchStatus.TERMINAL))
        stuck = s.scalar(select(func.count()).select_from(Request).where(
            Request.batch_id.in_(finished), Request.status == RequestStatus.PENDING))
        live = s.scalar(select(func.count()).select_from(Shard).where(
            Shard.batch_id.in_(finished), Shard.status.notin_(ShardStatus.TERMINAL)))
        unfinished = list(s.scalars(select(Batch.id).where(Batch.status.notin_(BatchStatus.TERMINAL))))
    return StoreHygiene(stuck, live, unfinished)

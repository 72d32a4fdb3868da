"""Anthropic's Message Batches as a face of the one batch pipeline: the create body's requests
become an input file of /v1/messages lines, the batch is an ordinary batch row (shards, engine,
exactly-once, costs, webhooks, retry and metrics as for any other), and its object and results
are rendered the way Anthropic's API shows them.

- Create: the body ``{"requests": [{"custom_id", "params"}, ...]}`` is read as a stream
  (``ijson``) from a spooled copy, never whole into memory, and written as JSONL lines
  ``{"custom_id", "method": "POST", "url": "/v1/messages", "body": params}``. What Anthropic
  refuses at create is refused here with a 400 naming the field: a body that is not that object,
  no requests or more than ``max_message_batch_requests``, a ``custom_id`` not of 1-64
  ``[a-zA-Z0-9_-]`` or repeated, ``params`` not an object (or holding what no database can
  store). ``params`` themselves are judged per request when it runs (anthropic_messages.py):
  a bad one is an ``errored`` result, the others run.
- The batch object: ``processing_status`` in_progress (validating, in progress, finalizing),
  canceling, or ended (completed, failed, expired, cancelled); ``request_counts`` all
  ``processing`` until it ends, as at Anthropic, then split by outcome; times as RFC 3339.
- Results: the output and error files the pipeline wrote, line by line: a 200 response is
  ``succeeded`` with its Message; a line cancelled or expired before it ran is ``canceled`` or
  ``expired``; anything else ``errored`` with Anthropic's error object (a 400 is an
  ``invalid_request_error`` naming the field). A batch that failed as a whole (its prompts over
  the token limit, say) answers every request ``errored`` with the reason.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO, Iterator, Optional

import ijson
import orjson
from sqlalchemy import delete, func, select, tuple_
from sqlalchemy.orm import Session

from nightshift.jobs.batches.anthropic_messages import MESSAGES
from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard
from nightshift.jobs.batches.progress import BatchProgress
from nightshift.jobs.errors import Conflict, InvalidInput, NotFound
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.storable import unstorable_value
from nightshift.settings import Settings
from nightshift.storage.objectstore import iter_lines

CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ENDED = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)
CANCELED_CODE, EXPIRED_CODE = "batch_cancelled", "batch_expired"   # lifecycle.drain_batch's codes


def convert_requests(body: BinaryIO, out: BinaryIO, max_requests: int) -> int:
    """Write the create body's requests to ``out`` as /v1/messages JSONL lines; the number of
    requests. InvalidInput (400) naming the field for what Anthropic refuses at create."""
    try:
        for prefix, event, value in ijson.parse(body):
            if prefix == "" and event == "map_key" and value != "requests":
                raise InvalidInput(f"{value}: Extra inputs are not permitted.", value, "invalid_request")
            if prefix == "" and event not in ("start_map", "map_key", "end_map"):
                raise InvalidInput("The body must be a JSON object with 'requests'.", None, "invalid_request")
        body.seek(0)
        seen: set[str] = set()
        count = 0
        for count, item in enumerate(ijson.items(body, "requests.item", use_float=True), start=1):
            if count > max_requests:
                raise InvalidInput(f"requests: a batch holds at most {max_requests} requests.", "requests",
                                   "invalid_request")
            where = f"requests.{count - 1}"
            if not isinstance(item, dict):
                raise InvalidInput(f"{where}: Input should be an object with 'custom_id' and 'params'.", where,
                                   "invalid_request")
            extra = set(item) - {"custom_id", "params"}
            if extra:
                name = sorted(extra)[0]
                raise InvalidInput(f"{where}.{name}: Extra inputs are not permitted.", f"{where}.{name}",
                                   "invalid_request")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
                raise InvalidInput(f"{where}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'.",
                                   f"{where}.custom_id", "invalid_request")
            if custom_id in seen:
                raise InvalidInput(f"{where}.custom_id: {custom_id!r} is used by another request; each request's "
                                   "custom_id must be unique in the batch.", f"{where}.custom_id", "invalid_request")
            seen.add(custom_id)
            params = item.get("params")
            if not isinstance(params, dict):
                raise InvalidInput(f"{where}.params: Field required (an object of Messages API parameters).",
                                   f"{where}.params", "invalid_request")
            unstorable = unstorable_value(params, f"{where}.params")
            if unstorable is not None:
                raise InvalidInput(f"{unstorable[0]}: it {unstorable[1]}.", unstorable[0], "invalid_request")
            out.write(orjson.dumps({"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}) + b"\n")
    except ijson.JSONError as err:
        raise InvalidInput(f"The body is not valid JSON: {err}.", None, "invalid_json") from None
    if count == 0:
        raise InvalidInput("requests: List should have at least 1 item.", "requests", "invalid_request")
    return count


def create_message_batch(session: Session, settings: Settings, *, project_id: str, input_file_id: str,
                         requests: int) -> Batch:
    """The batch of a recorded input file of /v1/messages lines (status validating; the caller
    commits, then sends the ingest wake-up)."""
    created = time.time()
    batch = Batch(id=new_id("msgbatch_"), project_id=project_id, input_file_id=input_file_id, endpoint=MESSAGES,
                  completion_window="24h", status=BatchStatus.VALIDATING, created_at=created,
                  expires_at=created + settings.completion_window_seconds, last_enqueued_at=created,
                  request_total=requests)
    session.add(batch)
    session.flush()
    return batch


def get_message_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.project_id != project_id or batch.endpoint != MESSAGES:
        raise NotFound("message batch", batch_id)
    return batch


def list_message_batches(session: Session, project_id: str, *, before_id: Optional[str] = None,
                         after_id: Optional[str] = None, limit: int = 20) -> tuple[list[Batch], bool]:
    """Newest first. ``after_id``: the page after that batch (older ones); ``before_id``: the page
    before it (newer ones, still newest first)."""
    query = select(Batch).where(Batch.project_id == project_id, Batch.endpoint == MESSAGES)
    if before_id and after_id:
        raise InvalidInput("Give either before_id or after_id, not both.", "before_id", "invalid_request")
    cursor_id = after_id or before_id
    if cursor_id:
        cursor = session.get(Batch, cursor_id)
        if cursor is None or cursor.project_id != project_id or cursor.endpoint != MESSAGES:
            raise NotFound("message batch", cursor_id, "after_id" if after_id else "before_id")
        key, at = tuple_(Batch.created_at, Batch.id), tuple_(cursor.created_at, cursor.id)
        if after_id:
            query = query.where(key < at).order_by(Batch.created_at.desc(), Batch.id.desc())
        else:
            query = query.where(key > at).order_by(Batch.created_at.asc(), Batch.id.asc())
    else:
        query = query.order_by(Batch.created_at.desc(), Batch.id.desc())
    rows = list(session.scalars(query.limit(limit + 1)))
    page, more = rows[:limit], len(rows) > limit
    if before_id:
        page.reverse()
    return page, more


def delete_message_batch(session: Session, project_id: str, batch_id: str) -> Batch:
    """Delete an ended batch and its shard and request rows (its files, cost report and webhook
    events stay, and expire as any other's)."""
    batch = get_message_batch(session, project_id, batch_id)
    if batch.status not in ENDED:
        raise Conflict(f"Batch {batch_id} cannot be deleted while it is processing: cancel it first, then delete "
                       "it once it has ended.", "invalid_state")
    for table in (Request, Shard):       # the database's cascade too, where foreign keys are not enforced
        session.execute(delete(table).where(table.batch_id == batch_id))
    session.execute(delete(Batch).where(Batch.id == batch_id))
    return batch


def outcome_counts(session: Session, batches: list[Batch]) -> dict[str, dict[str, int]]:
    """Per ended batch: its failed requests that were canceled, expired or errored."""
    ended = [b.id for b in batches if b.status in ENDED]
    out = {batch_id: {"canceled": 0, "expired": 0, "failed": 0} for batch_id in ended}
    if not ended:
        return out
    rows = session.execute(select(Request.batch_id, Request.error_code, func.count())
                           .where(Request.batch_id.in_(ended), Request.status == RequestStatus.FAILED)
                           .group_by(Request.batch_id, Request.error_code)).all()
    for batch_id, code, count in rows:
        counts = out[batch_id]
        counts["failed"] += count
        if code == CANCELED_CODE:
            counts["canceled"] += count
        elif code == EXPIRED_CODE:
            counts["expired"] += count
    return out


def _time(value: Optional[float]) -> Optional[str]:
    if value is None:
        return None
    return datetime.fromtimestamp(value, timezone.utc).isoformat().replace("+00:00", "Z")


def processing_status(batch: Batch) -> str:
    if batch.status in ENDED:
        return "ended"
    return "canceling" if batch.status == BatchStatus.CANCELLING else "in_progress"


def ended_at(batch: Batch) -> Optional[float]:
    return batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at


def message_batch_document(batch: Batch, progress: BatchProgress, outcomes: Optional[dict[str, int]],
                           results_url: str) -> dict[str, Any]:
    """Anthropic's MessageBatch object for one of our batches."""
    total = max(batch.request_total, progress.total)
    counts = {"processing": total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    status = processing_status(batch)
    if status == "ended":
        whole = whole_outcome(batch)
        if whole is not None:
            counts = {**counts, "processing": 0, whole: total}
        else:
            outcomes = outcomes or {"canceled": 0, "expired": 0, "failed": 0}
            canceled, expired = outcomes["canceled"], outcomes["expired"]
            counts = {"processing": 0, "succeeded": progress.completed,
                      "errored": total - progress.completed - canceled - expired, "canceled": canceled,
                      "expired": expired}
    return {"id": batch.id, "type": "message_batch", "processing_status": status, "request_counts": counts,
            "created_at": _time(batch.created_at), "expires_at": _time(batch.expires_at),
            "ended_at": _time(ended_at(batch)) if status == "ended" else None,
            "cancel_initiated_at": _time(batch.cancelling_at), "archived_at": None,
            "results_url": results_url if status == "ended" else None}


def _error_type(status_code: Optional[int]) -> str:
    if status_code == 400:
        return "invalid_request_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code in (503, 529):
        return "overloaded_error"
    return "api_error"


def _errored(message: str, error_type: str, request_id: Optional[str]) -> dict[str, Any]:
    return {"type": "errored", "error": {"type": "error", "error": {"type": error_type, "message": message},
                                         "request_id": request_id}}


def result_line(line: dict[str, Any]) -> dict[str, Any]:
    """One output- or error-file line of the pipeline as Anthropic's result line."""
    response, error = line.get("response"), line.get("error")
    if response is not None and response.get("status_code") == 200:
        return {"custom_id": line["custom_id"], "result": {"type": "succeeded", "message": response["body"]}}
    if response is not None:
        detail = (response.get("body") or {}).get("error") or {}
        message = detail.get("message") or "The request failed."
        if detail.get("param"):
            message = f"{detail['param']}: {message}"
        return {"custom_id": line["custom_id"],
                "result": _errored(message, _error_type(response.get("status_code")), response.get("request_id"))}
    code = (error or {}).get("code")
    if code == CANCELED_CODE:
        return {"custom_id": line["custom_id"], "result": {"type": "canceled"}}
    if code == EXPIRED_CODE:
        return {"custom_id": line["custom_id"], "result": {"type": "expired"}}
    message = (error or {}).get("message") or "The request could not be run."
    return {"custom_id": line["custom_id"], "result": _errored(message, "api_error", None)}


def failed_batch_reason(batch: Batch) -> str:
    data = (batch.errors or {}).get("data") or []
    reasons = "; ".join(entry.get("message") or "" for entry in data[:3] if entry.get("message"))
    return reasons or "The batch could not be processed."


def whole_outcome(batch: Batch) -> Optional[str]:
    """For an ended batch that wrote no result files (cancelled or expired before it ran, or
    failed as a whole): what every one of its requests is ("canceled", "expired", "errored")."""
    if batch.status not in ENDED or batch.output_file_id is not None or batch.error_file_id is not None:
        return None
    return {BatchStatus.CANCELLED: "canceled", BatchStatus.EXPIRED: "expired"}.get(batch.status, "errored")


@dataclass(frozen=True)
class ResultSources:
    """Where an ended batch's results come from: the pipeline's output and error files, or (see
    whole_outcome) its input file's custom_ids, each with ``whole``, one result for all."""
    keys: tuple[str, ...]
    whole: Optional[dict[str, Any]] = None


def result_sources(session: Session, batch: Batch) -> ResultSources:
    require_ended(batch)
    outcome = whole_outcome(batch)
    if outcome is not None:
        source = session.get(File, batch.input_file_id)
        whole = _errored(failed_batch_reason(batch), "invalid_request_error", None) if outcome == "errored" \
            else {"type": outcome}
        return ResultSources((source.object_key,) if source is not None else (), whole)
    keys = [session.get(File, file_id).object_key for file_id in (batch.output_file_id, batch.error_file_id)
            if file_id is not None]
    return ResultSources(tuple(keys))


def results_lines(store, sources: ResultSources) -> Iterator[bytes]:  # noqa: ANN001
    """The batch's results as JSONL, read from the files as they stream (no database held)."""
    for key in sources.keys:
        for raw in iter_lines(store.get_stream(key)):
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            if sources.whole is not None:
                result = {"custom_id": line["custom_id"], "result": sources.whole}
            else:
                result = result_line(line)
            yield orjson.dumps(result) + b"\n"


def require_ended(batch: Batch) -> None:
    if batch.status not in ENDED:
        raise Conflict(f"Batch {batch.id} is still processing ({processing_status(batch)}): its results are ready "
                       "once it has ended.", "invalid_state")

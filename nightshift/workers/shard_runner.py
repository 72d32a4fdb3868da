"""Run one shard: claim its lease, run its pending requests through one ``Engine.generate``
call (so the prefix cache sees the shard's shared prefixes), and write each result under
the lease as it finishes. A heartbeat thread keeps the lease alive; if the lease is lost
(reclaimed, cancelled, expired) the run stops and writes nothing more.

Transactions, each committed before the next step: the claim; reading the shard's pending
requests; every flush of results (every ``result_flush_rows`` results or
``result_flush_seconds``, so a crash loses little and the lease is re-asserted each time);
each heartbeat (on its own thread, with its own session); completing or releasing the
shard; moving the batch to finalizing.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

from nightshift.engine import GenerationOutput, GenerationRequest, SamplingParams
from nightshift.jobs.batches.leases import (Lease, LeaseLost, RequestResult, claim_shard, complete_shard,
                                            pending_requests, release_shard, renew_lease, write_results)
from nightshift.jobs.batches.lifecycle import start_finalize_if_done
from nightshift.jobs.batches.models import Batch, Request, RequestStatus
from nightshift.jobs.batches.openai_mapping import RequestBodyError, error_body, response_body, sampling_kwargs
from nightshift.jobs.ids import response_request_id
from nightshift.settings import Settings
from nightshift.storage.db import session_scope

log = logging.getLogger(__name__)


@dataclass
class ShardRun:
    status: str                     # "done" | "skipped" | "lease_lost" | "incomplete"
    written: int = 0
    finalize: bool = False          # this run moved the batch to finalizing
    lease: Optional[Lease] = None


class _Heartbeat(threading.Thread):
    """Extends the lease every heartbeat_seconds; when the lease is gone (cancel, expiry, or a
    reclaim after a stall) it aborts the shard's requests in the engine so the run stops now."""

    def __init__(self, lease: Lease, settings: Settings, engine):  # noqa: ANN001
        super().__init__(daemon=True, name=f"heartbeat-shard-{lease.shard_id}")
        self.lease, self.settings, self.engine = lease, settings, engine
        self.request_ids: list[str] = []
        self.stop_event = threading.Event()
        self.lost = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.settings.heartbeat_seconds):
            try:
                with session_scope(self.settings.resolved_database_url) as s:
                    renew_lease(s, self.lease, self.settings.lease_seconds)
            except LeaseLost:
                self.lost.set()
                for request_id in list(self.request_ids):
                    self.engine.abort(request_id)
                return
            except Exception:  # a DB hiccup: try again next beat; the lease outlives a few misses
                log.exception("heartbeat failed for shard %s", self.lease.shard_id)


def _result_from_output(row: Request, out: GenerationOutput, endpoint: str, model_name: str) -> RequestResult:
    if out.finish_reason == "error" or out.error is not None:
        err = out.error
        code, message, param = (err.code, err.message, err.param) if err else ("invalid_request", "rejected", None)
        return RequestResult(row.id, RequestStatus.FAILED, response_status_code=400,
                             response_body=error_body(code, message, param), finish_reason="error",
                             prompt_tokens=0, finished_at=out.finish_time)
    body = response_body(endpoint, response_request_id(row.id), int(out.finish_time), model_name, out.text,
                         out.finish_reason, out.prompt_tokens, out.cached_prompt_tokens, out.completion_tokens,
                         out.logprobs)
    return RequestResult(row.id, RequestStatus.COMPLETED, response_status_code=200, response_body=body,
                         finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                         cached_tokens=out.cached_prompt_tokens, completion_tokens=out.completion_tokens,
                         engine_seconds=out.engine_seconds, first_token_at=out.first_token_time,
                         finished_at=out.finish_time)


def run_shard(shard_id: int, engine, *, settings: Settings, owner: str, device: str) -> ShardRun:  # noqa: ANN001
    url = settings.resolved_database_url
    with session_scope(url) as s:
        lease = claim_shard(s, shard_id, owner, settings.lease_seconds, device=device)
    if lease is None:
        return ShardRun("skipped")
    beat = _Heartbeat(lease, settings, engine)
    beat.start()
    try:
        return _run_claimed(lease, engine, settings, device, beat)
    except LeaseLost:
        log.warning("shard %s: lease lost, stopping", shard_id)
        return ShardRun("lease_lost", lease=lease)
    except BaseException as e:
        with session_scope(url) as s:
            release_shard(s, lease, f"{type(e).__name__}: {e}")
        raise
    finally:
        beat.stop_event.set()


def _run_claimed(lease: Lease, engine, settings: Settings, device: str, beat: _Heartbeat) -> ShardRun:  # noqa: ANN001
    url = settings.resolved_database_url
    with session_scope(url) as s:
        endpoint = s.get(Batch, lease.batch_id).endpoint
        rows = pending_requests(s, lease)
    by_key: dict[str, Request] = {}
    requests: list[GenerationRequest] = []
    buffer: list[RequestResult] = []
    for row in rows:
        try:
            kwargs = sampling_kwargs(row.body, endpoint, len(row.prompt_token_ids), engine.max_model_len,
                                     settings.default_chat_max_tokens, settings.default_completion_max_tokens)
        except RequestBodyError as e:
            buffer.append(RequestResult(row.id, RequestStatus.FAILED, response_status_code=400,
                                        response_body=error_body(e.code, e.message, e.param),
                                        finish_reason="error", finished_at=time.time()))
            continue
        key = str(row.id)
        by_key[key] = row
        requests.append(GenerationRequest(key, list(row.prompt_token_ids), SamplingParams(**kwargs)))

    written = 0
    last_flush = time.monotonic()

    def flush() -> None:
        nonlocal written, last_flush
        if buffer:
            with session_scope(url) as s:
                written += write_results(s, lease, buffer, settings.lease_seconds, device=device)
            buffer.clear()
        last_flush = time.monotonic()

    flush()
    beat.request_ids = [r.request_id for r in requests]
    outputs = engine.generate(requests, offline=True)
    try:
        for out in outputs:
            if beat.lost.is_set():
                raise LeaseLost(f"shard {lease.shard_id}: heartbeat found the lease gone")
            if out.finish_reason == "abort":
                continue  # aborted on purpose (lease lost); it stays pending for whoever owns the shard
            buffer.append(_result_from_output(by_key[out.request_id], out, endpoint, engine.model_name))
            due = time.monotonic() - last_flush >= settings.result_flush_seconds
            if len(buffer) >= settings.result_flush_rows or due:
                flush()
    finally:
        outputs.close()  # stop the engine's remaining work if we leave early
    if beat.lost.is_set():
        raise LeaseLost(f"shard {lease.shard_id}: heartbeat found the lease gone")
    flush()
    with session_scope(url) as s:
        completed = complete_shard(s, lease)
    if not completed:
        # Lease revoked meanwhile, or outputs missing: hand the shard back for another attempt.
        with session_scope(url) as s:
            release_shard(s, lease, "requests left pending after generate")
        return ShardRun("incomplete", written, lease=lease)
    with session_scope(url) as s:
        moved = start_finalize_if_done(s, lease.batch_id)
    return ShardRun("done", written, finalize=moved, lease=lease)

"""An engine worker's stream of shards: one long ``Engine.generate`` that keeps the engine full
across shard boundaries, with every result still written under its own shard's lease.

A ``run_shard`` task claims its shard and starts the engine on that shard's pending requests.
While they run, this worker also takes further pending shards ahead (a shard whose wake-up has
waited ``claim_ahead_after_seconds`` without an idle worker taking it), up to
``engine_stream_seconds`` after the task started: each is claimed and loaded before the engine
runs short of waiting sequences, then fed in (``RequestFeed``), so the engine never drains to
an empty batch at a shard boundary and never waits for a shard's set-up. When nothing is left
to take, the engine finishes what it has and the task ends; the wake-ups of the shards taken
ahead find them done.

Two threads. The engine thread only runs ``generate`` and queues each finished output. The
database thread does everything else, each step in its own transaction: it writes results in
bulk (one transaction per shard per ``result_flush_rows`` / ``result_flush_seconds``,
re-asserting that shard's lease; ``jobs.batches.leases.write_results``), marks a shard done
when its last result is written and moves its batch to finalizing (then sends the finalize
wake-up), renews every held lease each ``heartbeat_seconds``, and claims and loads the next
shard. A shard whose lease is lost (cancel, expiry, a reclaim after a stall) has its requests
aborted in the engine and its unwritten results dropped: they stay pending for whoever owns
the shard now. On an error every shard still held is handed back and re-sent: an engine error
ends the stream with the engine's exception; an error of the database thread other than a
database hiccup (those it retries) aborts the engine's requests and ends it with a RuntimeError,
so the engine never waits on a thread that is gone.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from sqlalchemy import Row

from nightshift.engine import GenerationOutput, GenerationRequest
from nightshift.jobs.batches.leases import (Lease, LeaseLost, RequestResult, claim_next_shard, claim_shard,
                                            complete_shard, pending_requests, release_shard, renew_lease,
                                            write_results)
from nightshift.jobs.batches.lifecycle import start_finalize_if_done
from nightshift.jobs.batches.models import Batch, RequestStatus
from nightshift.jobs.batches.openai_mapping import CHAT, COMPLETIONS, RequestBodyError, error_body, sampling_kwargs
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.workers.generation_results import engine_sampling, generation_result, tool_format_of
from nightshift.workers.metrics import worker_metrics

log = logging.getLogger(__name__)

CLAIM_RETRY_SECONDS = 0.25    # while busy, look for claimable shards again this often


@dataclass
class StreamRun:
    status: str                       # the task's own shard: "done", "skipped", "lease_lost", "incomplete"
    shards_done: list[int] = field(default_factory=list)
    finalize: list[str] = field(default_factory=list)     # batches this stream moved to finalizing
    results_written: int = 0


@dataclass
class HeldShard:
    """A shard this worker holds the lease of, and what is left of it."""
    lease: Lease
    endpoint: str
    rows: dict[str, Row]                      # pending_requests rows, by engine request id
    requests: list[GenerationRequest]
    results: list[RequestResult]              # finished, not yet written
    outstanding: int                          # results not yet written
    lost: bool = False


@dataclass
class StreamTimings:
    claim: float = 0.0
    load: float = 0.0
    writes: float = 0.0
    flushes: int = 0
    heartbeats: float = 0.0
    complete: float = 0.0
    generate: float = 0.0
    step_seconds: float = 0.0         # of `generate`, the engine's steps (the rest: admission, feed waits, queueing)
    steps: int = 0
    database_cpu: float = 0.0         # CPU time of the database thread (it shares the GIL with the engine's)
    shards: int = 0
    requests: int = 0


def run_shard(shard_id: int, engine, *, settings: Settings, owner: str, device: str,  # noqa: ANN001
              on_finalize: Callable[[str], None] = lambda batch_id: None,
              on_released: Callable[[int], None] = lambda shard_id: None) -> StreamRun:
    """Run shard ``shard_id`` and, while its requests run, the shards this worker takes ahead.
    ``on_finalize(batch_id)`` is called after the commit that moved a batch to finalizing,
    ``on_released(shard_id)`` after a shard was handed back unfinished (both send wake-ups)."""
    return ShardStream(engine, settings, owner, device, on_finalize, on_released).run(shard_id)


class ShardStream:
    # Shards of these endpoints are taken ahead (this stream's engine runs them); a subclass for
    # another engine overrides it with `_engine_request` and `_result_of` (embedding_stream.py).
    endpoints: tuple[str, ...] = (CHAT, COMPLETIONS)

    def __init__(self, engine, settings: Settings, owner: str, device: str,  # noqa: ANN001
                 on_finalize: Callable[[str], None], on_released: Callable[[int], None]):
        self.engine, self.settings, self.owner, self.device = engine, settings, owner, device
        self.on_finalize, self.on_released = on_finalize, on_released
        self.url = settings.resolved_database_url
        self.low_water = engine.config.max_num_seqs       # keep a step's worth of sequences queued
        self.tool_format = tool_format_of(engine)          # the model's own tool-call format, if any
        self.claim_until = time.monotonic() + settings.engine_stream_seconds
        # `cond` guards everything both threads touch: outputs, held, owner_of, prepared and the
        # claim requests. A held shard's own fields are the database thread's alone.
        self.cond = threading.Condition()
        self.outputs: deque[GenerationOutput] = deque()
        self.held: dict[int, HeldShard] = {}               # fed to the engine
        self.prepared: Optional[HeldShard] = None          # claimed and loaded ahead, not yet fed
        self.owner_of: dict[str, int] = {}                 # engine request id -> shard id
        self.claim_wanted = 0                              # claim requests made ...
        self.claims_done = 0                               # ... and answered
        self.claim_forced = False                          # the engine is idle: no retry throttle
        self.last_empty_claim = -1e9                       # monotonic time a claim last found nothing
        self.stopping = False
        self.first_shard_id: Optional[int] = None
        self.run_result = StreamRun("done")
        self.timings = StreamTimings()
        self.error: Optional[BaseException] = None            # the engine thread's
        self.database_error: Optional[BaseException] = None   # the database thread's (not a hiccup)

    # ---- the engine thread -------------------------------------------------------------
    def run(self, shard_id: int) -> StreamRun:
        started = time.perf_counter()
        with session_scope(self.url) as s:
            lease = claim_shard(s, shard_id, self.owner, self.settings.lease_seconds, device=self.device)
        self.timings.claim += time.perf_counter() - started
        if lease is None:
            return StreamRun("skipped")
        _count_claim(lease, "own")
        self.first_shard_id = shard_id
        first = self._load(lease)
        with self.cond:
            self._hold(first)
        database = threading.Thread(target=self._database_loop, name=f"shard-stream-db-{shard_id}", daemon=True)
        database.start()
        generate_started = time.perf_counter()
        steps_before = self._step_totals()
        outputs = self.engine.generate(first.requests, offline=True, feed=self)
        try:
            for out in outputs:
                with self.cond:
                    self.outputs.append(out)
                    if len(self.outputs) >= self.settings.result_flush_rows:
                        self.cond.notify_all()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            outputs.close()
            self.timings.generate = time.perf_counter() - generate_started
            steps_after = self._step_totals()
            if steps_before is not None and steps_after is not None:
                self.timings.steps = steps_after[0] - steps_before[0]
                self.timings.step_seconds = steps_after[1] - steps_before[1]
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            database.join()
            self._log_timings(shard_id)
        if self.database_error is not None:
            raise RuntimeError(f"shard stream of shard {shard_id}: the database thread failed "
                               f"({type(self.database_error).__name__}: {self.database_error}); "
                               "its shards were handed back") from self.database_error
        if self.run_result.status == "done" and shard_id not in self.run_result.shards_done:
            self.run_result.status = "incomplete"
        return self.run_result

    def _step_totals(self) -> Optional[tuple[int, float]]:
        """(steps, their seconds) the engine has run so far, from its own accounting (Engine.stats);
        None for an engine without it (the embedding stream's generator)."""
        stats = getattr(self.engine, "stats", None)
        if stats is None:
            return None
        totals = stats()
        return totals.num_steps, totals.prefill_seconds + totals.decode_seconds

    def take(self, waiting: int, idle: bool) -> Optional[list[GenerationRequest]]:
        """RequestFeed: the prepared shard's requests once the engine runs short of waiting ones;
        when the engine is idle, a fresh claim is waited for, and nothing found ends the stream."""
        with self.cond:
            if self.prepared is None and idle and self._may_claim():
                wanted = self._want_claim(forced=True)
                self.cond.wait_for(lambda: self.prepared is not None or self.claims_done >= wanted or self.stopping)
            if self.prepared is not None and (idle or waiting < self.low_water):
                shard, self.prepared = self.prepared, None
                self._hold(shard)
                return shard.requests
            if idle:
                return None
            # Running short: claim the next shard now, so it is loaded before the engine needs it.
            if waiting < self.low_water and self.prepared is None and self._may_claim() \
                    and self.claims_done >= self.claim_wanted:
                self._want_claim()
            return []

    def _may_claim(self) -> bool:
        return time.monotonic() < self.claim_until and not self.stopping

    def _want_claim(self, forced: bool = False) -> int:
        self.claim_wanted = self.claims_done + 1
        self.claim_forced = forced
        self.cond.notify_all()
        return self.claim_wanted

    def _hold(self, shard: HeldShard) -> None:
        """(under `cond`) The shard's requests are in the engine now."""
        self.held[shard.lease.shard_id] = shard
        for request in shard.requests:
            self.owner_of[request.request_id] = shard.lease.shard_id
        self.timings.shards += 1
        self.timings.requests += shard.outstanding

    def _load(self, lease: Lease) -> HeldShard:
        """The shard's pending requests as engine requests; bodies the engine cannot run become
        error results right away."""
        started = time.perf_counter()
        with session_scope(self.url) as s:
            endpoint = s.get(Batch, lease.batch_id).endpoint
            rows = pending_requests(s, lease)
        shard = HeldShard(lease, endpoint, {}, [], [], len(rows))
        for row in rows:
            try:
                request = self._engine_request(row, endpoint)
            except RequestBodyError as e:
                shard.results.append(RequestResult(row.id, RequestStatus.FAILED, response_status_code=400,
                                                   response_body=error_body(e.code, e.message, e.param),
                                                   finish_reason="error", finished_at=time.time()))
                continue
            shard.rows[request.request_id] = row
            shard.requests.append(request)
        self.timings.load += time.perf_counter() - started
        return shard

    def _engine_request(self, row: Row, endpoint: str) -> GenerationRequest:
        """The engine request of a pending row (its id: str(row.id)); RequestBodyError if the
        body cannot run."""
        kwargs = sampling_kwargs(row.body, endpoint, len(row.prompt_token_ids), self.engine.max_model_len,
                                 self.settings.default_chat_max_tokens, self.settings.default_completion_max_tokens,
                                 self.tool_format, self.settings.accepted_model_names())
        return GenerationRequest(str(row.id), list(row.prompt_token_ids), engine_sampling(kwargs))

    def _result_of(self, row: Row, out, endpoint: str) -> RequestResult:  # noqa: ANN001
        return generation_result(row, out, endpoint, self.engine.model_name, self.engine.tokenizer, self.tool_format)

    # ---- the database thread -----------------------------------------------------------
    def _database_loop(self) -> None:
        cpu_started = time.thread_time()
        try:
            self._database_steps()
        except BaseException as exc:  # a bug, not a database hiccup (_database_steps retries those)
            log.exception("shard stream: the database thread failed; aborting its requests, handing its shards back")
            self._abandon(exc)
        finally:
            self.timings.database_cpu = time.thread_time() - cpu_started

    def _abandon(self, exc: BaseException) -> None:
        """The database thread cannot go on: stop the stream (an idle engine waiting on a claim
        wakes up), abort every held request in the engine and hand every shard back unwritten."""
        with self.cond:
            self.database_error = exc
            self.stopping = True
            leftovers = list(self.held.values()) + ([self.prepared] if self.prepared is not None else [])
            self.held.clear()
            self.prepared = None
            self.cond.notify_all()
        for shard in leftovers:
            for key in list(shard.rows):
                self.engine.abort(key)
            if not shard.lost:
                self._release(shard, f"{type(exc).__name__}: {exc}")

    def _database_steps(self) -> None:
        settings = self.settings
        next_flush = time.monotonic() + settings.result_flush_seconds
        next_beat = time.monotonic() + settings.heartbeat_seconds
        buffered = 0
        failures = 0
        while True:
            with self.cond:
                def ready() -> bool:
                    now = time.monotonic()
                    return (self.stopping or now >= next_beat or self._claim_due(now)
                            or buffered + len(self.outputs) >= settings.result_flush_rows
                            or (buffered + len(self.outputs) > 0 and now >= next_flush))
                self.cond.wait_for(ready, timeout=max(0.001, min(next_flush, next_beat) - time.monotonic()))
                stopping = self.stopping
                claim = self._claim_due(time.monotonic()) and not stopping
                buffered += self._collect()
            try:
                if claim:
                    self._claim_ahead()
                now = time.monotonic()
                if stopping or (buffered and now >= next_flush) or buffered >= settings.result_flush_rows:
                    self._flush()
                    buffered = 0
                    next_flush = time.monotonic() + settings.result_flush_seconds
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + settings.heartbeat_seconds
                failures = 0
            except Exception:  # a database hiccup: results stay buffered and are written next round
                failures += 1
                log.exception("shard stream: database step failed (%d in a row); retrying", failures)
                if stopping and failures < 10:
                    time.sleep(0.5)
                    continue
                if not stopping:
                    time.sleep(min(2.0, 0.1 * failures))
                    continue
            if stopping:
                self._finish()
                return

    def _claim_due(self, now: float) -> bool:
        """(under `cond`) A claim the engine asked for is unanswered. Whether to ask is decided
        when asking (`take`, inside the stream's window); once asked it is answered even if the
        window closed meanwhile, since an idle engine waits on the answer."""
        return (self.claim_wanted > self.claims_done and self.prepared is None and not self.stopping
                and (self.claim_forced or now - self.last_empty_claim >= CLAIM_RETRY_SECONDS))

    def _collect(self) -> int:
        """(under `cond`) The engine's finished outputs, as results of their shards."""
        count = 0
        while self.outputs:
            out = self.outputs.popleft()
            shard = self.held.get(self.owner_of.pop(out.request_id, -1))
            if shard is None or shard.lost or out.finish_reason == "abort":
                continue   # aborted on purpose (lease lost): it stays pending for the shard's new owner
            shard.results.append(self._result_of(shard.rows.pop(out.request_id), out, shard.endpoint))
            count += 1
        return count

    def _claim_ahead(self) -> None:
        started = time.perf_counter()
        with session_scope(self.url) as s:
            lease = claim_next_shard(s, self.owner, self.settings.lease_seconds, device=self.device,
                                     waiting_since=time.time() - self.settings.claim_ahead_after_seconds,
                                     endpoints=self.endpoints)
        self.timings.claim += time.perf_counter() - started
        if lease is not None:
            _count_claim(lease, "ahead")
        shard = self._load(lease) if lease is not None else None
        with self.cond:
            self.claims_done = self.claim_wanted
            self.claim_forced = False
            if shard is None:
                self.last_empty_claim = time.monotonic()
            else:
                self.prepared = shard
            self.cond.notify_all()

    def _flush(self) -> None:
        """Each shard's finished results in one transaction under its lease; then the shards
        whose last result is written are completed."""
        with self.cond:
            shards = [s for s in self.held.values() if not s.lost]
        for shard in shards:
            if not shard.results:
                continue
            started = time.perf_counter()
            try:
                with session_scope(self.url) as s:
                    written = write_results(s, shard.lease, shard.results, self.settings.lease_seconds,
                                            device=self.device)
            except LeaseLost:
                self._lose(shard)
                continue
            finally:
                self.timings.writes += time.perf_counter() - started
                self.timings.flushes += 1
            self.run_result.results_written += written
            _count_results(shard.results)
            shard.outstanding -= len(shard.results)
            shard.results = []
        for shard in shards:
            if shard.outstanding == 0 and not shard.lost:
                self._complete(shard)

    def _complete(self, shard: HeldShard) -> None:
        started = time.perf_counter()
        with session_scope(self.url) as s:
            done = complete_shard(s, shard.lease)
            moved = done and start_finalize_if_done(s, shard.lease.batch_id)
        self.timings.complete += time.perf_counter() - started
        with self.cond:
            self.held.pop(shard.lease.shard_id, None)
        if not done:   # its lease was revoked meanwhile, or a request is still pending
            self._release(shard, "requests left pending after generate")
            return
        self.run_result.shards_done.append(shard.lease.shard_id)
        if moved:
            self.run_result.finalize.append(shard.lease.batch_id)
            self.on_finalize(shard.lease.batch_id)

    def _heartbeat(self) -> None:
        started = time.perf_counter()
        with self.cond:
            shards = [s for s in self.held.values() if not s.lost] + \
                ([self.prepared] if self.prepared is not None else [])
        for shard in shards:
            try:
                with session_scope(self.url) as s:
                    renew_lease(s, shard.lease, self.settings.lease_seconds)
            except LeaseLost:
                self._lose(shard)
        self.timings.heartbeats += time.perf_counter() - started

    def _lose(self, shard: HeldShard) -> None:
        log.warning("shard %s: lease lost, stopping its requests", shard.lease.shard_id)
        shard.lost = True
        shard.results = []
        for key in list(shard.rows):
            self.engine.abort(key)
        with self.cond:
            self.held.pop(shard.lease.shard_id, None)
            if self.prepared is shard:
                self.prepared = None
        if shard.lease.shard_id == self.first_shard_id:
            self.run_result.status = "lease_lost"

    def _finish(self) -> None:
        """After generate: write what is left; hand back whatever could not be finished."""
        try:
            self._flush()
        except Exception:  # still failing: the shards go back (or their leases run out)
            log.exception("shard stream: could not write the last results")
        with self.cond:
            leftovers = [s for s in self.held.values() if not s.lost] + \
                ([self.prepared] if self.prepared is not None else [])
            self.held.clear()
            self.prepared = None
        reason = "the engine stopped before its requests finished" if self.error is None else \
            f"{type(self.error).__name__}: {self.error}"
        for shard in leftovers:
            self._release(shard, reason)

    def _release(self, shard: HeldShard, reason: str) -> None:
        try:
            with session_scope(self.url) as s:
                released = release_shard(s, shard.lease, reason)
        except Exception:  # its lease runs out and the reconciler re-sends it instead
            log.exception("shard %s: could not hand it back", shard.lease.shard_id)
            return
        if released:
            self.on_released(shard.lease.shard_id)

    def _log_timings(self, shard_id: int) -> None:
        t = self.timings
        log.info("timing stream=%s shards=%d requests=%d claim=%.4f load=%.4f generate=%.4f step_seconds=%.4f "
                 "steps=%d writes=%.4f flushes=%d complete=%.4f heartbeats=%.4f database_cpu=%.4f", shard_id, t.shards,
                 t.requests, t.claim, t.load, t.generate, t.step_seconds, t.steps, t.writes, t.flushes, t.complete,
                 t.heartbeats, t.database_cpu)


def _count_claim(lease: Lease, kind: str) -> None:
    m = worker_metrics()
    m.shard_claims.labels(kind).inc()
    if lease.attempt > 1:
        m.shard_retries.inc()


def _count_results(results: list[RequestResult]) -> None:
    """(A re-run shard may count a result its earlier attempt wrote; the database counts stay exact.)"""
    m = worker_metrics()
    for outcome in (RequestStatus.COMPLETED, RequestStatus.FAILED):
        n = sum(r.status == outcome for r in results)
        if n:
            m.requests.labels(outcome).inc(n)
    for kind, n in (("prompt", sum(r.prompt_tokens for r in results)), ("cached", sum(r.cached_tokens for r in results)),
                    ("completion", sum(r.completion_tokens for r in results))):
        if n:
            m.tokens.labels(kind).inc(n)

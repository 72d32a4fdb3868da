"""One round of ``bench.chaos``: a batch submitted through the API of a running ``Cluster``
(bench/services.py), one kind of fault injected into it at random points, and the promises
checked once it is over (``bench.invariants``).

Fault kinds (``KINDS``):

- ``engine_kill``: SIGKILL the engine worker (with its pool child) holding a running shard that
  still has pending requests, once a random share of the batch is answered; once or twice a
  round. The worker is started again at once, as a supervisor would.
- ``finalize_kill``: SIGKILL the cpu worker while its finalize holds the batch's finalize lease.
  S3 is paused from the moment the batch runs, so the finalize is pinned inside its writes
  when the kill lands; S3 resumes right after.
- ``redis_restart``: SIGKILL the broker mid-batch and start it again empty (every queued and
  unacknowledged wake-up lost).
- ``s3_pause_batch``: SIGSTOP the S3 endpoint mid-batch, SIGCONT a few seconds later.
- ``s3_pause_finalize``: S3 paused before the batch finalizes, resumed a while after the
  finalize took its lease (long enough, at times, for its S3 calls to time out and retry).
- ``api_restart_upload``: SIGKILL the API (uvicorn with its workers) during a large upload, at a
  random point (often during its multipart upload to S3), and start it again. Afterwards the
  file exists whole or not at all, and once the upkeep sweep has run (sent by the chaos, once
  what the upload left is older than ``abandoned_upload_seconds``) no multipart upload is left
  and no object under ``files/`` lacks its row.
- ``postgres_restart``: a fast restart of the cluster's own Postgres mid-batch (every session
  ended, the server back in about a second).
- ``postgres_outage``: Postgres crashed mid-batch (an immediate stop: no shutdown checkpoint,
  crash recovery at the start) and kept down ``Timings.postgres_down`` (20 s), then started.
- ``postgres_restart_finalize``: a fast restart while the batch's finalize holds its lease
  (pinned inside its writes by a paused S3, as for ``finalize_kill``).

During every Postgres fault an ``ApiProbe`` polls the batch through the API: while the database
is away the API must answer 503 with Retry-After (never 500, never slower than
``Timings.api_answer_limit``), and 200 again within ``Timings.api_back_within`` of its return.
After every round no process of the cluster has died (workers reconnect by themselves).

Each fault records when it ended (the kill, Redis back up, S3 resumed) and, from then, how long
until the batch made progress again and until it was over (for the API: until it answered
again and until the upload was checked).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

import httpx
import orjson
from sqlalchemy import select

from bench.invariants import BatchCheck, StoreHygiene, check_batch, database_leftovers
from bench.services import Cluster
from nightshift.jobs.batches.models import Batch, BatchStatus, Shard, ShardStatus
from nightshift.jobs.files.models import File
from nightshift.storage.db import session_scope
from nightshift.storage.s3 import S3Store

KINDS = ("engine_kill", "finalize_kill", "redis_restart", "s3_pause_batch", "s3_pause_finalize",
         "api_restart_upload", "postgres_restart", "postgres_outage", "postgres_restart_finalize")
POSTGRES_KINDS = ("postgres_restart", "postgres_outage", "postgres_restart_finalize")
T = TypeVar("T")


class RoundTimeout(RuntimeError):
    """A round waited longer than its limit for something (the batch did not recover)."""


@dataclass
class Fault:
    kind: str
    detail: str
    at: float                              # monotonic time the fault ended
    progress_s: Optional[float] = None     # from then until the batch made progress again
    done_s: Optional[float] = None         # from then until the batch was over (the upload checked)
    facts: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)    # promises it broke (the API's, for Postgres faults)


@dataclass
class RoundResult:
    index: int
    kind: str
    batch_id: str
    requests: int
    faults: list[Fault]
    missed: int                            # fault points the batch had already passed
    check: Optional[BatchCheck]
    leftovers: Optional[StoreHygiene]
    problems: list[str]                    # the upload's, or why the round could not finish
    seconds: float

    @property
    def ok(self) -> bool:
        return (not self.problems and self.check is not None and self.check.ok and self.leftovers is not None
                and self.leftovers.ok)


@dataclass
class ShardState:
    id: int
    seq: int
    status: str
    owner: Optional[str]
    done: int
    size: int
    attempt: int


@dataclass
class BatchState:
    status: str
    finalize_leased: bool
    shards: list[ShardState]

    @property
    def done(self) -> int:
        return sum(s.done for s in self.shards)

    @property
    def over(self) -> bool:
        return self.status in BatchStatus.TERMINAL


@dataclass
class Timings:
    """The random ranges of the faults, in seconds."""

    batch_pause: tuple[float, float] = (2.0, 15.0)
    finalize_pause: tuple[float, float] = (2.0, 40.0)
    redis_down: tuple[float, float] = (0.0, 3.0)
    postgres_down: tuple[float, float] = (20.0, 20.0)
    api_answer_limit: float = 5.0       # while the database is away, an API answer takes at most this
    api_back_within: float = 2.0        # and the first 200 comes this soon after it is back
    round_timeout: float = 600.0


class Chaos:
    """Runs rounds against ``cluster``; random choices come from ``rng``."""

    def __init__(self, cluster: Cluster, rng: random.Random, *, requests: int, max_tokens: int,
                 upload_bytes: int = 24 * 2 ** 20, timings: Optional[Timings] = None):
        self.c, self.rng = cluster, rng
        self.requests, self.max_tokens, self.upload_bytes = requests, max_tokens, upload_bytes
        self.timings = timings or Timings()
        self.db = cluster.database_url
        self.settings = cluster.settings()
        self.store = S3Store.from_settings(self.settings)
        self.s3 = cluster.s3.client()
        self.http = httpx.Client(base_url=cluster.base_url, headers={"Authorization": f"Bearer {cluster.api_key}"},
                                 timeout=120)
        self._celery = None     # a Celery app on the cluster's broker, to send the upkeep sweep

    def close(self) -> None:
        self.http.close()
        if self._celery is not None:
            self._celery.close()

    # ---- one round -------------------------------------------------------------------------
    def run_round(self, index: int, kind: str) -> RoundResult:
        started = time.monotonic()
        tag = f"r{index}"
        try:
            batch_id, ids = self.submit(tag)
        except httpx.HTTPError as exc:
            return RoundResult(index, kind, "", 0, [], 0, None, None, [f"could not submit a batch: {exc!r}"],
                               time.monotonic() - started)
        faults: list[Fault] = []
        problems: list[str] = []
        missed = 0
        check = leftovers = None
        try:
            if kind == "api_restart_upload":
                fault, problems = self.api_restart_upload(tag)
                faults.append(fault)
            else:
                faults, missed = getattr(self, kind)(batch_id)
            ended = self.wait(lambda: self.state(batch_id).over, f"batch {batch_id} to end")
            for fault in faults:
                if fault.done_s is None:
                    fault.done_s = ended - fault.at
                problems += fault.problems
            check = check_batch(self.db, self.store, batch_id, ids)
            leftovers = database_leftovers(self.db)
            dead = [name for name in ["api", *self.c.worker_names] if not self.c.alive(name)]
            if dead:
                problems.append(f"processes died and were not restarted: {dead}")
        except RoundTimeout as exc:
            problems.append(str(exc))
        finally:
            if self.c.s3.paused:
                self.c.s3.resume()
        return RoundResult(index, kind, batch_id, len(ids), faults, missed, check, leftovers, problems,
                           time.monotonic() - started)

    def warm_up(self) -> float:
        """One batch before the rounds, so every engine worker has loaded its engine (each loads
        lazily on its first shard); its seconds."""
        started = time.monotonic()
        batch_id, _ = self.submit("warm-up")
        self.wait(lambda: self.state(batch_id).over, "the warm-up batch")
        return time.monotonic() - started

    def submit(self, tag: str) -> tuple[str, list[str]]:
        """Upload ``requests`` chat lines and create their batch through the API."""
        data = chat_lines(self.requests, self.max_tokens, tag)
        upload = self.http.post("/files", data={"purpose": "batch"}, files={"file": (f"{tag}.jsonl", data)})
        upload.raise_for_status()
        created = self.http.post("/batches", json={"input_file_id": upload.json()["id"],
                                                   "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        created.raise_for_status()
        return created.json()["id"], [f"{tag}-{i}" for i in range(self.requests)]

    # ---- a schedule beside the rounds ----------------------------------------------------
    SCHEDULE_PREFIX = "chaos-docs/"

    def start_schedule(self) -> str:
        """A schedule due every minute (one document under a prefix: its first run makes a
        batch, the later ones find nothing changed), so that ``schedule_report`` can tell whether
        beat kept firing through the rounds' faults: each due time once, none lost."""
        self.store.put_stream(self.SCHEDULE_PREFIX + "a.txt", b"The lighthouse keeper counts the ships.")
        created = self.http.post("/schedules", json={
            "name": "chaos-every-minute", "cron": "* * * * *", "timezone": "UTC",
            "endpoint": "/v1/chat/completions", "model": "default",
            "source": {"type": "prefix", "prefix": self.SCHEDULE_PREFIX}, "index_prefix": "chaos-index/",
            "prompt_template": {"messages": [{"role": "user", "content": "Summarize: {{ document }}"}],
                                "max_tokens": 4}})
        created.raise_for_status()
        self.schedule = (created.json()["id"], time.time())
        return self.schedule[0]

    def schedule_report(self) -> tuple[dict, list[str]]:
        """(facts, broken promises) of the schedule started by ``start_schedule``: its runs by due
        time, every due minute from its creation until a tick ago fired exactly once."""
        from nightshift.jobs.schedules.models import ScheduleRun

        schedule_id, created = self.schedule
        settled = time.time() - self.settings.schedule_tick_seconds - 15
        with session_scope(self.db) as s:
            due = [row for row in s.scalars(select(ScheduleRun.due_at).where(ScheduleRun.schedule_id == schedule_id))]
        counts: dict[int, int] = {}
        for at in due:
            counts[int(at)] = counts.get(int(at), 0) + 1
        expected = list(range(int(created // 60 + 1) * 60, int(settled // 60) * 60 + 1, 60))
        duplicated = sum(n - 1 for n in counts.values())
        missing = [at for at in expected if at not in counts]
        problems = []
        if duplicated:
            problems.append(f"schedule: {duplicated} due time(s) fired twice")
        if missing:
            problems.append(f"schedule: {len(missing)} due time(s) never fired: {missing}")
        return {"runs": len(due), "due_minutes": len(expected), "duplicated": duplicated, "missing": len(missing)}, \
            problems

    # ---- observing the batch -------------------------------------------------------------
    def state(self, batch_id: str) -> BatchState:
        """The batch as the database has it (waits while the database itself is away)."""
        return self.poll(lambda: self._state_or_none(batch_id), "the database to answer", interval=0.2)

    def _state_or_none(self, batch_id: str) -> Optional[BatchState]:
        from sqlalchemy.exc import OperationalError
        try:
            return self._read_state(batch_id)
        except OperationalError:
            return None

    def _read_state(self, batch_id: str) -> BatchState:
        with session_scope(self.db) as s:
            batch = s.get(Batch, batch_id)
            shards = [ShardState(r.id, r.seq, r.status, r.lease_owner, r.completed_count + r.failed_count,
                                 r.num_requests, r.attempt)
                      for r in s.scalars(select(Shard).where(Shard.batch_id == batch_id).order_by(Shard.seq))]
            return BatchState(batch.status, batch.finalize_lease_expires_at is not None, shards)

    def poll(self, find: Callable[[], Optional[T]], what: str, interval: float = 0.05,
             timeout: Optional[float] = None) -> T:
        """Call ``find()`` until it returns something other than None, and return that;
        RoundTimeout after ``timeout`` (the round's limit by default)."""
        timeout = self.timings.round_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            value = find()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RoundTimeout(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    def wait(self, predicate: Callable[[], bool], what: str, interval: float = 0.1) -> float:
        """Poll until ``predicate()``; the monotonic time it held."""
        return self.poll(lambda: time.monotonic() if predicate() else None, what, interval)

    def _progress(self, batch_id: str, fault: Fault, moved: Callable[[BatchState], bool]) -> None:
        """Record when the batch made progress again after ``fault`` (``moved``, or the batch over)."""
        def progressed() -> bool:
            st = self.state(batch_id)
            return st.over or moved(st)

        fault.progress_s = self.wait(progressed, f"progress after {fault.kind}") - fault.at

    def _answered_past(self, batch_id: str, share: float) -> Optional[BatchState]:
        """The batch's state once ``share`` of its requests are answered, or once it is past
        in_progress; None while it is validating or short of that share."""
        st = self.state(batch_id)
        if st.status == BatchStatus.VALIDATING:
            return None
        return st if st.status != BatchStatus.IN_PROGRESS or st.done >= share * self.requests else None

    # ---- faults ----------------------------------------------------------------------------
    def engine_kill(self, batch_id: str) -> tuple[list[Fault], int]:
        faults: list[Fault] = []
        for _ in range(self.rng.randint(1, 2)):
            if faults:   # a second kill, at a point the batch has not passed yet (if any is left)
                st = self.state(batch_id)
                answered = st.done / self.requests
                if st.status != BatchStatus.IN_PROGRESS or answered >= 0.8:
                    break
                share = self.rng.uniform(answered, 0.8)
            else:
                share = self.rng.uniform(0.1, 0.8)
            victim = self.poll(lambda: self._engine_victim(batch_id, share), "an engine worker mid-shard")
            if victim == "missed":   # only the first kill can miss: a second one is optional
                return faults, 0 if faults else 1
            name, shard_id = victim
            self.c.kill(name)
            at = time.monotonic()
            # read after the kill: what the dead worker had written is final until another takes over
            shard = next(s for s in self.state(batch_id).shards if s.id == shard_id)
            fault = Fault("engine_kill", f"{name} held shard {shard.seq} at {shard.done}/{shard.size}", at,
                          facts={"shard_id": shard.id, "done": shard.done, "size": shard.size,
                                 "attempt": shard.attempt, "status": shard.status, "worker": name})
            self.c.start(name)
            self._progress(batch_id, fault, lambda st: any(
                s.id == shard.id and (s.done > shard.done or s.status in ShardStatus.TERMINAL) for s in st.shards))
            faults.append(fault)
        return faults, 0

    def _engine_victim(self, batch_id: str, share: float):  # noqa: ANN202
        """None (not yet), "missed" (the batch left in_progress), or (worker, shard) to kill: an
        engine worker holding a running shard with requests still pending."""
        st = self._answered_past(batch_id, share)
        if st is None:
            return None
        if st.status != BatchStatus.IN_PROGRESS:
            return "missed"
        running = [s for s in st.shards if s.status == ShardStatus.RUNNING and s.done < s.size]
        self.rng.shuffle(running)
        # the most requests still to run first: a shard one answer from its end may be done by
        # the time the kill lands (a fast engine writes it within milliseconds)
        running.sort(key=lambda s: s.done - s.size)
        for shard in running:
            name = self.c.owner_of_lease(shard.owner)
            if name in self.c.engines:
                return name, shard.id
        return None

    def _pin_finalize(self, batch_id: str) -> bool:
        """Pause S3 once the batch runs (ingest has read its file), then wait until its finalize
        holds the finalize lease, stuck on S3. False if the batch ended first."""
        self.wait(lambda: self.state(batch_id).status != BatchStatus.VALIDATING, "ingest")
        self.c.s3.pause()

        def pinned_or_over() -> Optional[BatchState]:
            st = self.state(batch_id)
            return st if st.over or (st.status == BatchStatus.FINALIZING and st.finalize_leased) else None

        return not self.poll(pinned_or_over, "finalize to take its lease").over

    def finalize_kill(self, batch_id: str) -> tuple[list[Fault], int]:
        try:
            if not self._pin_finalize(batch_id):
                return [], 1
            time.sleep(self.rng.uniform(0.0, 1.5))
            st = self.state(batch_id)
            if not (st.status == BatchStatus.FINALIZING and st.finalize_leased):
                return [], 1
            self.c.kill("cpu")
            fault = Fault("finalize_kill", "cpu worker killed inside finalize (S3 held paused)", time.monotonic(),
                          facts={"status": st.status, "finalize_leased": st.finalize_leased})
            time.sleep(self.rng.uniform(0.0, 2.0))
        finally:
            self.c.s3.resume()
        self.c.start("cpu")
        self._progress(batch_id, fault, lambda st: False)
        return [fault], 0

    def s3_pause_finalize(self, batch_id: str) -> tuple[list[Fault], int]:
        try:
            if not self._pin_finalize(batch_id):
                return [], 1
            hold = self.rng.uniform(*self.timings.finalize_pause)
            time.sleep(hold)
        finally:
            self.c.s3.resume()
        fault = Fault("s3_pause_finalize", f"S3 paused; finalize stalled {hold:.1f}s", time.monotonic(),
                      facts={"hold": hold})
        self._progress(batch_id, fault, lambda st: False)
        return [fault], 0

    def _mid_batch(self, batch_id: str) -> Optional[BatchState]:
        """The batch's state at a random point between 10% and 70% answered; None if it was
        past in_progress by then (the fault is missed)."""
        share = self.rng.uniform(0.1, 0.7)
        st = self.poll(lambda: self._answered_past(batch_id, share), "a point mid-batch")
        return st if st.status == BatchStatus.IN_PROGRESS else None

    def s3_pause_batch(self, batch_id: str) -> tuple[list[Fault], int]:
        st = self._mid_batch(batch_id)
        if st is None:
            return [], 1
        hold = self.rng.uniform(*self.timings.batch_pause)
        self.c.s3.pause()
        try:
            time.sleep(hold)
        finally:
            self.c.s3.resume()
        done = self.state(batch_id).done
        fault = Fault("s3_pause_batch", f"S3 paused {hold:.1f}s at {st.done}/{self.requests}", time.monotonic(),
                      facts={"hold": hold, "done": st.done})
        self._progress(batch_id, fault, lambda now: now.done > done)
        return [fault], 0

    def redis_restart(self, batch_id: str) -> tuple[list[Fault], int]:
        st = self._mid_batch(batch_id)
        if st is None:
            return [], 1
        pending = sum(s.status == ShardStatus.PENDING for s in st.shards)
        self.c.redis.restart(self.rng.uniform(*self.timings.redis_down))
        done = self.state(batch_id).done
        fault = Fault("redis_restart", f"broker restarted empty at {st.done}/{self.requests} "
                                       f"({pending} shard(s) waiting)", time.monotonic(),
                      facts={"done": st.done, "pending_shards": pending})
        self._progress(batch_id, fault, lambda now: now.done > done)
        return [fault], 0

    # ---- Postgres ----------------------------------------------------------------------------
    def postgres_restart(self, batch_id: str) -> tuple[list[Fault], int]:
        st = self._mid_batch(batch_id)
        if st is None:
            return [], 1
        fault = self._postgres_fault(batch_id, "postgres_restart", lambda: self.c.postgres.restart(),
                                     f"fast restart at {st.done}/{self.requests}", st.done)
        return [fault], 0

    def postgres_outage(self, batch_id: str) -> tuple[list[Fault], int]:
        st = self._mid_batch(batch_id)
        if st is None:
            return [], 1
        down = self.rng.uniform(*self.timings.postgres_down)
        fault = self._postgres_fault(batch_id, "postgres_outage", lambda: self.c.postgres.outage(down),
                                     f"crashed at {st.done}/{self.requests}, down {down:.0f}s", st.done)
        return [fault], 0

    def postgres_restart_finalize(self, batch_id: str) -> tuple[list[Fault], int]:
        def restart_then_resume_s3() -> None:
            self.c.postgres.restart()
            self.c.s3.resume()

        try:
            if not self._pin_finalize(batch_id):
                return [], 1
            fault = self._postgres_fault(batch_id, "postgres_restart_finalize", restart_then_resume_s3,
                                         "fast restart while finalize held its lease (S3 held paused)", None)
        finally:
            self.c.s3.resume()
        return [fault], 0

    def _postgres_fault(self, batch_id: str, kind: str, act: Callable[[], None], detail: str,
                        done: Optional[int]) -> Fault:
        """Run ``act`` (a restart or an outage) with the API probed before, during and after it;
        then wait for the batch's next result (``done``: answered before the fault), or for it
        to be over (None)."""
        probe = ApiProbe(self.c.base_url, self.http.headers, f"/batches/{batch_id}").start()
        try:
            time.sleep(0.3)
            down_at = time.monotonic()
            act()
            back_at = time.monotonic()
            fault = Fault(kind, detail, back_at)
            self._progress(batch_id, fault, (lambda now: now.done > done) if done is not None else (lambda now: False))
            time.sleep(max(0.0, back_at + self.timings.api_back_within + 1.0 - time.monotonic()))
        finally:
            probe.stop()
        fault.facts, fault.problems = probe.report(down_at, back_at, self.timings)
        fault.detail += f"; API: {fault.facts['summary']}"
        return fault

    def api_restart_upload(self, tag: str) -> tuple[Fault, list[str]]:
        """Kill the API during a large upload, start it again, then check the file is whole or
        absent and that the sweep leaves no multipart upload and no object without a row."""
        filename = f"big-{tag}.jsonl"
        data = big_upload(self.upload_bytes, tag)
        outcome: dict = {}

        def send() -> None:
            try:
                response = httpx.post(f"{self.c.base_url}/files", headers=self.http.headers, timeout=300,
                                      data={"purpose": "batch"}, files={"file": (filename, data)})
                outcome["status"], outcome["body"] = response.status_code, response.text
                if response.status_code == 200:
                    outcome["id"] = response.json()["id"]
            except httpx.HTTPError as exc:
                outcome["status"] = type(exc).__name__

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        when = self.rng.choice(["during its multipart upload", "at a random time"])
        if when == "during its multipart upload":
            self.poll(lambda: True if self._multipart_uploads() or not sender.is_alive() else None,
                       "the API's multipart upload to S3", interval=0.02)
            time.sleep(self.rng.uniform(0.0, 0.5))
        else:
            time.sleep(self.rng.uniform(0.0, 1.5))
        self.c.kill("api")
        fault = Fault("api_restart_upload", f"API killed {when}", time.monotonic())
        self.c.start("api")
        self.c.wait_ready(["api"], timeout=self.timings.round_timeout)
        fault.progress_s = time.monotonic() - fault.at
        sender.join(300)
        # whatever the killed upload left is older than abandoned_upload_seconds before the sweep runs
        time.sleep(max(0.0, fault.at + self.settings.abandoned_upload_seconds + 1 - time.monotonic()))
        problems = self._upload_problems(filename, data, outcome)
        fault.done_s = time.monotonic() - fault.at
        fault.facts = {"client": outcome.get("status"), "kept": outcome.get("kept")}
        fault.detail += f" (client saw {outcome.get('status')}; the file {outcome.get('kept')})"
        return fault, problems

    def _multipart_uploads(self) -> list[dict]:
        return self.s3.list_multipart_uploads(Bucket=self.c.bucket).get("Uploads", [])

    def _upload_problems(self, filename: str, data: bytes, outcome: dict) -> list[str]:
        from nightshift.workers.celery_app import TASK_SWEEP_STORAGE, make_celery

        problems = []
        with session_scope(self.db) as s:
            rows = [(r.id, r.bytes, r.object_key) for r in s.scalars(select(File).where(File.filename == filename))]
        if outcome.get("status") == 200 and [r[0] for r in rows] != [outcome["id"]]:
            problems.append(f"upload answered 200 ({outcome['id']}) but the file rows are {rows}")
        if len(rows) > 1:
            problems.append(f"{len(rows)} file rows for one upload: {rows}")
        for file_id, size, key in rows:
            stored = b"".join(self.store.get_stream(key)) if self.store.exists(key) else None
            if stored != data or size != len(data):
                problems.append(f"file {file_id} is not whole: row says {size} bytes, object "
                                f"{None if stored is None else len(stored)}, uploaded {len(data)}")
        outcome["kept"] = "exists whole" if rows and not problems else "is absent" if not rows else "is broken"
        if self._celery is None:
            self._celery = make_celery(self.settings)
        task_id = self._celery.send_task(TASK_SWEEP_STORAGE, queue="upkeep").id
        done = f"Task {TASK_SWEEP_STORAGE}[{task_id}] succeeded"
        try:
            self.poll(lambda: True if done in self.c.log("upkeep", tail=200_000) else None, "the upkeep sweep",
                      interval=0.5, timeout=60)
        except RoundTimeout as exc:
            problems.append(str(exc))
        if self._multipart_uploads():
            problems.append(f"multipart uploads left after the sweep: {self._multipart_uploads()}")
        with session_scope(self.db) as s:
            known = set(s.scalars(select(File.object_key)))
        listed = self.s3.list_objects_v2(Bucket=self.c.bucket, Prefix="files/").get("Contents", [])
        orphans = [o["Key"] for o in listed if o["Key"] not in known]
        if orphans:
            problems.append(f"objects without a file row: {orphans}")
        return problems


class ApiProbe:
    """Polls one API path every ``interval`` seconds in a thread, from ``start()`` to ``stop()``,
    recording each answer: when it was sent (monotonic), how long it took, its status (or the
    client error's class name) and its Retry-After header."""

    def __init__(self, base_url: str, headers, path: str, interval: float = 0.1, timeout: float = 30.0):
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self.path, self.interval = path, interval
        self.samples: list[tuple[float, float, object, Optional[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="api-probe")

    def start(self) -> "ApiProbe":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                response = self.client.get(self.path)
                status, retry_after = response.status_code, response.headers.get("retry-after")
            except httpx.HTTPError as exc:
                status, retry_after = type(exc).__name__, None
            self.samples.append((sent, time.monotonic() - sent, status, retry_after))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()

    def report(self, down_at: float, back_at: float, timings: Timings) -> tuple[dict, list[str]]:
        """(facts, broken promises): the answers sent while the database was away (from
        ``down_at`` to ``back_at``), the slowest of them, and how soon after ``back_at`` a 200 came."""
        during = [s for s in self.samples if down_at <= s[0] < back_at]
        statuses: dict[str, int] = {}
        for _, _, status, _ in during:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        slowest = max((s[1] for s in during), default=0.0)
        first_ok = next((s[0] + s[1] for s in self.samples if s[0] >= back_at and s[2] == 200), None)
        back_s = None if first_ok is None else first_ok - back_at
        problems = []
        bad = {k: v for k, v in statuses.items() if k not in ("200", "503")}
        if bad:
            problems.append(f"the API answered {bad} while the database was away (expected 200 or 503)")
        if any(s[2] == 503 and not s[3] for s in during):
            problems.append("a 503 without Retry-After while the database was away")
        if slowest > timings.api_answer_limit:
            problems.append(f"an API answer took {slowest:.1f}s while the database was away")
        if back_s is None or back_s > timings.api_back_within:
            problems.append(f"no 200 within {timings.api_back_within:.0f}s of the database's return "
                            f"({'none' if back_s is None else f'{back_s:.1f}s'})")
        summary = (", ".join(f"{n}x {k}" for k, n in sorted(statuses.items())) or "no request while down") + \
            f", slowest {slowest:.2f}s, 200 again {'never' if back_s is None else f'{back_s:.2f}s'} after"
        return {"statuses": statuses, "slowest_s": slowest, "back_s": back_s, "summary": summary}, problems


def chat_lines(n: int, max_tokens: int, tag: str) -> bytes:
    """``n`` chat lines (custom_id <tag>-<i>) whose max_tokens spread over 1..``max_tokens``, each
    made in full (ignore_eos): a shard's answers land one after another rather than all on its
    last step, so there are points inside a shard to inject a fault at."""
    return b"".join(orjson.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "default", "max_tokens": 1 + (i * 5) % max_tokens, "temperature": 0, "ignore_eos": True,
                 "messages": [{"role": "system", "content": "You answer in one short sentence."},
                              {"role": "user", "content": f"Tell me a fact about the number {i}."}]}}) + b"\n"
        for i in range(n))


def big_upload(size: int, tag: str) -> bytes:
    """About ``size`` bytes of valid batch lines (``custom_id`` big-<tag>-<n>)."""
    head = b'{"custom_id": "big-%s-%%09d", "method": "POST", "url": "/v1/chat/completions", "body": ' % tag.encode()
    line = head + b'{"model": "default", "messages": [{"role": "user", "content": "' + b"a" * 2000 + b'"}]}}\n'
    return b"".join(line % i for i in range(max(1, size // len(line % 0))))

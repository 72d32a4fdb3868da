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
         "api_restart_upload")
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
            check = check_batch(self.db, self.store, batch_id, ids)
            leftovers = database_leftovers(self.db)
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

    # ---- observing the batch -------------------------------------------------------------
    def state(self, batch_id: str) -> BatchState:
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

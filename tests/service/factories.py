"""Rows for service tests, written straight through the models (no API, no engine), and
domain calls made the way a worker makes them: each in a transaction of its own."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import orjson

from nightshift.jobs.batches.models import Batch, BatchStatus, Request, RequestStatus, Shard
from nightshift.jobs.files.models import File
from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import Project
from nightshift.storage.db import session_scope

T = TypeVar("T")


def in_transaction(db_url: str, work: Callable[..., T], *args, **kwargs) -> T:  # noqa: ANN002, ANN003
    """``work(session, *args, **kwargs)`` in one transaction, committed when it returns (rolled
    back if it raises)."""
    with session_scope(db_url) as s:
        return work(s, *args, **kwargs)


def make_project(db_url: str, name: str | None = None) -> str:
    pid = new_id("proj_")
    with session_scope(db_url) as s:
        s.add(Project(id=pid, name=name or pid))
    return pid


def make_input_file(db_url: str, store, project_id: str, lines: list[dict] | list[bytes]) -> str:  # noqa: ANN001
    fid = new_id("file-")
    data = b"".join((ln if isinstance(ln, bytes) else orjson.dumps(ln)) + b"\n" for ln in lines)
    key = f"files/{fid}"
    store.put_stream(key, data)
    with session_scope(db_url) as s:
        s.add(File(id=fid, project_id=project_id, filename="input.jsonl", purpose="batch", bytes=len(data),
                   object_key=key, status="processed"))
    return fid


def make_batch(db_url: str, project_id: str, file_id: str, endpoint: str = "/v1/chat/completions",
               window: float = 24 * 3600) -> str:
    bid = new_id("batch_")
    now = time.time()
    with session_scope(db_url) as s:
        s.add(Batch(id=bid, project_id=project_id, input_file_id=file_id, endpoint=endpoint,
                    completion_window="24h", status=BatchStatus.VALIDATING, created_at=now, expires_at=now + window))
    return bid


def make_running_batch(db_url: str, store, n_requests: int, n_shards: int) -> tuple[str, list[int]]:  # noqa: ANN001
    """An in_progress batch with pending requests spread over shards (as ingest leaves it)."""
    pid = make_project(db_url)
    fid = make_input_file(db_url, store, pid, [b"{}"])
    bid = make_batch(db_url, pid, fid)
    now = time.time()
    with session_scope(db_url) as s:
        shards = [Shard(batch_id=bid, seq=i, status="pending", enqueued_at=now) for i in range(n_shards)]
        s.add_all(shards)
        s.flush()
        for i in range(n_requests):
            shard = shards[i % n_shards]
            shard.num_requests += 1
            s.add(Request(batch_id=bid, shard_id=shard.id, line=i + 1, custom_id=f"req-{i}",
                          body={"model": "default", "messages": [{"role": "user", "content": str(i)}]},
                          prompt_token_ids=[1, 2, 3], status=RequestStatus.PENDING, queued_at=now))
        batch = s.get(Batch, bid)
        batch.status, batch.in_progress_at, batch.request_total = BatchStatus.IN_PROGRESS, now, n_requests
        shard_ids = [sh.id for sh in shards]
    return bid, shard_ids


def run_batch_in_process(db_url: str, store, settings, lines: list[dict], *, endpoint: str,  # noqa: ANN001
                         run_one: Callable[[int], object], tokenizer=None,  # noqa: ANN001
                         load_tokenizer: Callable[[], object] | None = None) -> tuple[str, list[int]]:
    """A batch of ``lines`` ingested, then ``run_one(shard_id)`` (a shard stream) for each of its
    shards; returns (batch id, shard ids). A stream takes further shards ahead, so a later
    shard's own run may find it done; exactly one run moves the batch to finalizing."""
    from nightshift.workers.ingest import ingest_batch

    pid = make_project(db_url)
    bid = make_batch(db_url, pid, make_input_file(db_url, store, pid, lines), endpoint=endpoint)
    outcome = ingest_batch(bid, tokenizer, settings=settings, store=store, load_tokenizer=load_tokenizer)
    assert outcome.status == "in_progress", outcome
    runs = [run_one(sid) for sid in outcome.shard_ids]
    assert runs[0].status == "done" and {r.status for r in runs} <= {"done", "skipped"}
    assert sorted(sid for r in runs for sid in r.shards_done) == sorted(outcome.shard_ids)
    assert [b for r in runs for b in r.finalize] == [bid]
    return bid, outcome.shard_ids


def read_result_lines(store, db_url: str, file_id: str) -> list[dict]:  # noqa: ANN001
    """The JSON lines of a result file (output or errors)."""
    with session_scope(db_url) as s:
        key = s.get(File, file_id).object_key
    return [orjson.loads(x) for x in b"".join(store.get_stream(key)).splitlines()]

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

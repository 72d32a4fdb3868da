"""Pipeline benchmark: how fast ingest is, and what the service adds on top of the engine.

  python -m bench.pipeline ingest   [--lines 50000] [--database-url URL]
      validation + tokenization + planning + bulk insert of one N-line file; prints lines/s.
  python -m bench.pipeline pipeline [--requests 2000] [--max-tokens 8] [--mode embedded|services]
      the same requests through Engine.generate alone (in this process), then as a batch through
      real Celery workers (embedded: SQLite + local folder + filesystem://; services: Postgres +
      Redis + S3); prints end-to-end time against engine-only time and the overhead.

Model load is excluded from both sides (the workers are warmed up with a small batch first).
Temporary databases, buckets and folders are created and removed by the command.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import orjson

CHAT = "/v1/chat/completions"
SYSTEMS = [
    "You are a support assistant for an online bookshop. Answer in one short sentence and be friendly.",
    "You are a travel helper. Reply with a single practical tip, no lists, no more than twenty words.",
    "You are a maths tutor for children. Explain briefly and kindly, using simple words only.",
    "You are a product copywriter. Write one catchy line about the item the user names.",
]


def request_lines(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"bench-{i}", "method": "POST", "url": CHAT,
             "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                                   {"role": "user", "content": f"Request number {i}: tell me something."}]}}
            for i in range(n)]


@contextlib.contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    import sqlalchemy as sa

    name = f"nightshift_bench_{os.getpid()}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        from nightshift.storage.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def moto_s3() -> Iterator[tuple[str, str]]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="b",
                 aws_secret_access_key="b").create_bucket(Bucket="nightshift-bench")
    try:
        yield endpoint, "nightshift-bench"
    finally:
        server.stop()


def _configure(env: dict[str, str]) -> None:
    from nightshift.settings import get_settings
    from nightshift.storage.objectstore import reset_object_store_cache

    for key in [k for k in os.environ if k.startswith("NIGHTSHIFT_") and k != "NIGHTSHIFT_MODEL_CACHE"]:
        del os.environ[key]
    os.environ.update(env)
    get_settings.cache_clear()
    reset_object_store_cache()


def _new_batch(db_url: str, store, lines: list[dict]) -> str:  # noqa: ANN001
    from nightshift.jobs.batches.models import Batch
    from nightshift.jobs.files.models import File
    from nightshift.jobs.ids import new_id
    from nightshift.jobs.projects.models import Project
    from nightshift.storage.db import session_scope

    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    pid, fid, bid = new_id("proj_"), new_id("file-"), new_id("batch_")
    store.put_stream(f"files/{fid}", data)
    now = time.time()
    with session_scope(db_url) as s:
        s.add(Project(id=pid, name=pid))
        s.flush()
        s.add(File(id=fid, project_id=pid, filename="bench.jsonl", purpose="batch", bytes=len(data),
                   object_key=f"files/{fid}", status="processed", line_count=len(lines)))
        s.flush()
        s.add(Batch(id=bid, project_id=pid, input_file_id=fid, endpoint=CHAT, completion_window="24h",
                    status="validating", created_at=now, expires_at=now + 86400))
    return bid


# --- ingest -----------------------------------------------------------------------------

def bench_ingest(args: argparse.Namespace) -> None:
    from nightshift.engine import load_tokenizer
    from nightshift.settings import get_settings
    from nightshift.migrations import upgrade_head
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.ingest import ingest_batch

    work = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
    try:
        with (postgres_database(args.pg_admin_url) if args.db == "postgres" else contextlib.nullcontext(None)) as pg:
            db_url = pg or f"sqlite:///{work / 'bench.db'}"
            _configure({"NIGHTSHIFT_HOME": str(work), "NIGHTSHIFT_DATABASE_URL": db_url})
            upgrade_head(db_url)
            tokenizer = load_tokenizer(get_settings().model)
            store = get_object_store()
            lines = request_lines(args.lines, 16)
            bid = _new_batch(db_url, store, lines)
            size = store.size(f"files/{_file_of(db_url, bid)}")
            t0 = time.perf_counter()
            outcome = ingest_batch(bid, tokenizer, settings=get_settings(), store=store)
            elapsed = time.perf_counter() - t0
            assert outcome.status == "in_progress", outcome
            parts = ", ".join(f"{k} {v:.2f}s" for k, v in outcome.seconds.items() if k != "total")
            print(f"ingest+validation ({args.db}): {args.lines} lines, {size / 1e6:.1f} MB, {len(outcome.shard_ids)} "
                  f"shards in {elapsed:.2f}s = {args.lines / elapsed:,.0f} lines/s ({parts})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _file_of(db_url: str, bid: str) -> str:
    from nightshift.jobs.batches.models import Batch
    from nightshift.storage.db import session_scope

    with session_scope(db_url) as s:
        return s.get(Batch, bid).input_file_id


# --- pipeline ---------------------------------------------------------------------------

def engine_only_seconds(lines: list[dict]) -> tuple[float, int]:
    from nightshift.engine import GenerationRequest, SamplingParams
    from nightshift.jobs.batches.openai_mapping import sampling_kwargs
    from nightshift.settings import get_settings
    from nightshift.workers.engine_host import get_engine

    settings = get_settings()
    engine = get_engine()
    reqs = []
    for ln in lines:
        ids = engine.tokenizer.apply_chat_template(ln["body"]["messages"], add_generation_prompt=True)
        kw = sampling_kwargs(ln["body"], CHAT, len(ids), engine.max_model_len, settings.default_chat_max_tokens,
                             settings.default_completion_max_tokens)
        reqs.append(GenerationRequest(ln["custom_id"], ids, SamplingParams(**kw)))
    list(engine.generate(reqs[:2]))  # warm-up, like the workers' warm-up batch
    t0 = time.perf_counter()
    outs = list(engine.generate(reqs, offline=True))
    elapsed = time.perf_counter() - t0
    return elapsed, sum(o.completion_tokens for o in outs)


def _wait_done(db_url: str, bid: str, timeout: float) -> str:
    from nightshift.jobs.batches.models import Batch
    from nightshift.storage.db import session_scope

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with session_scope(db_url) as s:
            status = s.get(Batch, bid).status
        if status in ("completed", "failed", "expired", "cancelled"):
            return status
        time.sleep(0.2)
    raise TimeoutError(f"batch {bid} not done after {timeout}s")


def pipeline_seconds(env: dict[str, str], lines: list[dict], timeout: float, log_dir: Path) -> dict:
    from nightshift.jobs.batches.models import Batch, Shard
    from nightshift.settings import get_settings
    from sqlalchemy import func, select
    from nightshift.migrations import upgrade_head
    from nightshift.storage.db import session_scope
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.celery_app import TASK_INGEST, make_celery
    from nightshift.workers.procs import service_env, start_worker, stop

    _configure(env)
    settings = get_settings()
    db_url = settings.resolved_database_url
    upgrade_head(db_url)
    store = get_object_store()
    app = make_celery(settings)
    wenv = service_env(**{k[len("NIGHTSHIFT_"):].lower(): v for k, v in env.items()})
    gpu = start_worker(wenv, "gpu", "bench-gpu", log_dir / "gpu.log")
    cpu = start_worker(wenv, "cpu", "bench-cpu", log_dir / "cpu.log", beat=True)
    try:
        warm = _new_batch(db_url, store, lines[:2])
        app.send_task(TASK_INGEST, args=[warm], queue="cpu")
        _wait_done(db_url, warm, timeout)
        bid = _new_batch(db_url, store, lines)
        t0 = time.time()
        app.send_task(TASK_INGEST, args=[bid], queue="cpu")
        status = _wait_done(db_url, bid, timeout)
        elapsed = time.time() - t0
    finally:
        stop(cpu)
        stop(gpu)
    with session_scope(db_url) as s:
        b = s.get(Batch, bid)
        first_claim, last_done, engine_secs = s.execute(
            select(func.min(Shard.started_at), func.max(Shard.finished_at), func.sum(Shard.engine_seconds))
            .where(Shard.batch_id == bid)).one()
        n_shards = s.scalar(select(func.count()).select_from(Shard).where(Shard.batch_id == bid))
        return {"status": status, "seconds": elapsed, "ingest": b.in_progress_at - t0,
                "run": last_done - first_claim, "finalize": (b.completed_at or last_done) - last_done,
                "shards": n_shards}


def bench_pipeline(args: argparse.Namespace) -> None:
    lines = request_lines(args.requests, args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
    try:
        _configure({"NIGHTSHIFT_HOME": str(work)})
        engine_s, out_tokens = engine_only_seconds(lines)
        import gc

        import nightshift.workers.engine_host as host

        host._engine = None  # free the model before the workers load theirs
        gc.collect()
        print(f"engine only: {args.requests} requests, {out_tokens} output tokens in {engine_s:.2f}s")
        with contextlib.ExitStack() as stack:
            if args.mode == "embedded":
                env = {"NIGHTSHIFT_HOME": str(work / "home")}
            else:
                pg = stack.enter_context(postgres_database(args.pg_admin_url))
                endpoint, bucket = stack.enter_context(moto_s3())
                env = {"NIGHTSHIFT_HOME": str(work / "home"), "NIGHTSHIFT_DATABASE_URL": pg,
                       "NIGHTSHIFT_BROKER_URL": args.redis_url, "NIGHTSHIFT_OBJECT_STORE": "s3",
                       "NIGHTSHIFT_S3_BUCKET": bucket, "NIGHTSHIFT_S3_ENDPOINT_URL": endpoint,
                       "NIGHTSHIFT_S3_ACCESS_KEY_ID": "b", "NIGHTSHIFT_S3_SECRET_ACCESS_KEY": "b"}
            result = pipeline_seconds(env, lines, args.timeout, work)
        overhead = (result["seconds"] - engine_s) / engine_s * 100
        print(f"pipeline ({args.mode}): {result['status']} in {result['seconds']:.2f}s "
              f"(ingest {result['ingest']:.2f}s, shards {result['run']:.2f}s over {result['shards']} shard(s), "
              f"finalize {result['finalize']:.2f}s)")
        print(f"pipeline overhead vs engine only: {overhead:+.1f}% (target < 10%)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ingest", help="validation + ingest rate of an N-line file")
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--db", choices=["sqlite", "postgres"], default="postgres")
    p.add_argument("--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    p.set_defaults(func=bench_ingest)
    p = sub.add_parser("pipeline", help="end-to-end batch time vs engine-only time")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--mode", choices=["embedded", "services"], default="embedded")
    p.add_argument("--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(func=bench_pipeline)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

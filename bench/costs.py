"""What cost accounting adds to finalize, measured: `python -m bench.costs --rows 50000`.

Creates a scratch Postgres database (NIGHTSHIFT_BENCH_PG_ADMIN_URL, default the local
server), migrates it, inserts one finished batch of N request rows, then times
write_cost_files (cost.json + cost.csv to a local folder) and costs_by_day. Drops the
database at the end. Prints one line per step.
"""
from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time

import sqlalchemy as sa

ADMIN_URL = os.environ.get("NIGHTSHIFT_BENCH_PG_ADMIN_URL",
                           "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _seed(url: str, rows: int) -> str:
    from nightshift.jobs.batches.models import Batch, Request
    from nightshift.jobs.files.models import File
    from nightshift.jobs.ids import new_id
    from nightshift.jobs.projects.models import Project
    from nightshift.storage.db import session_scope

    batch_id, now = new_id("batch_"), time.time()
    with session_scope(url) as s:
        s.add(Project(id="proj_bench", name="bench"))
        s.flush()
        s.add(File(id="file-bench", project_id="proj_bench", filename="in.jsonl", purpose="batch",
                   bytes=1, object_key="files/file-bench"))
        s.flush()
        s.add(Batch(id=batch_id, project_id="proj_bench", input_file_id="file-bench",
                    endpoint="/v1/chat/completions", status="completed", model="default"))
        s.flush()
        s.execute(sa.insert(Request), [
            {"batch_id": batch_id, "line": i + 1, "custom_id": f"req-{i}", "body": {}, "prompt_token_ids": [],
             "status": "completed", "response_status_code": 200, "prompt_tokens": 200 + i % 50,
             "cached_tokens": 128, "completion_tokens": 40 + i % 7, "engine_seconds": 0.01 + (i % 13) / 1000,
             "worker": "gpu-1@host", "device": "cuda:0" if i % 2 else "cpu", "queued_at": now,
             "started_at": now + i / 100, "finished_at": now + i / 100 + 1}
            for i in range(rows)])
    return batch_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    args = parser.parse_args()

    from nightshift.jobs.batches.models import Batch
    from nightshift.jobs.costs.batch_costs import write_cost_files
    from nightshift.jobs.costs.daily_costs import costs_by_day
    from nightshift.settings import Settings
    from nightshift.migrations import upgrade_head
    from nightshift.storage.db import dispose_engines, session_scope
    from nightshift.storage.localdir import LocalDirStore

    name = f"nightshift_cost_bench_{secrets.token_hex(4)}"
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade_head(url)
        t0 = time.perf_counter()
        batch_id = _seed(url, args.rows)
        print(f"seed {args.rows} request rows: {time.perf_counter() - t0:.2f} s")
        settings = Settings()
        with tempfile.TemporaryDirectory() as folder:
            store = LocalDirStore(folder)
            for attempt in (1, 2):
                t0 = time.perf_counter()
                with session_scope(url) as s:
                    report = write_cost_files(s, store, s.get(Batch, batch_id), settings=settings, now=time.time())
                print(f"write_cost_files (cost.json + cost.csv), run {attempt}: "
                      f"{time.perf_counter() - t0:.2f} s, {report['requests']['total']} rows, "
                      f"${report['cost']['usd']:.4f}, csv {store.size(f'batches/{batch_id}/cost.csv') / 1e6:.1f} MB")
        t0 = time.perf_counter()
        with session_scope(url) as s:
            daily = costs_by_day(s, "proj_bench", start=0, end=time.time() + 86400 * 2, settings=settings)
        print(f"costs_by_day over {daily['total']['requests']} rows: {time.perf_counter() - t0:.3f} s")
    finally:
        dispose_engines()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


if __name__ == "__main__":
    main()

"""Faults against the production shape, and what they did: ``python -m bench.chaos``.

  python -m bench.chaos --rounds N [--seed S] [--requests R] [--max-tokens T] [--kinds k1,k2]
                        [--engine-workers 2] [--shard-requests 4] [--upload-mb 24]
                        [--set NAME=VALUE ...] [--work DIR]

Starts the production shape on this machine (a new Postgres database, a redis-server of its own,
moto's S3 server in its own process, uvicorn with two workers, engine workers with the real
default model, a cpu worker, an upkeep worker with beat: ``bench.services.cluster``), then runs
N rounds (after one warm-up batch that makes every engine worker load its engine). Each round
submits one batch of R chat requests (max_tokens spread over 1..T) through the API and injects
one kind of fault at random points (``bench.chaos_faults``: kill an engine worker
mid-shard, kill the cpu worker inside finalize, restart Redis, pause S3 mid-batch or during
finalize, kill the API during a large upload); the kinds take turns in a seeded order. After
each round: the batch is terminal, every custom_id is in its output or error file exactly once,
its usage and cost report equal the sums of its lines, no request row or shard of a finished
batch is left live (``bench.invariants``) and no process of the cluster died. Postgres is the
cluster's own (restartable); during its faults the API is polled: 503 with Retry-After while the
database is away, 200 within 2 s of its return (the API table). A schedule due every minute
runs beside the rounds: at the end, every due minute fired exactly once.

Prints a line per round and, at the end, a table per fault kind (injected, missed, the time
from the fault to the batch making progress again and to it being over) and the totals (lost,
duplicated, stuck). Exits 1 if anything was lost, duplicated, stuck or mis-counted.
Settings are the service's defaults (lease 30 s, reconcile every 5 s, ...) except a small shard
size, so that the two engine workers share each batch; ``--set lease_seconds=10`` changes any.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from bench.chaos_faults import KINDS, POSTGRES_KINDS, Chaos, RoundResult
from bench.services import cluster
from nightshift.jobs.batches.models import BatchStatus

MEASURED = {
    "engine_kill": ("the killed shard's next result", "batch over"),
    "finalize_kill": ("batch over", "batch over"),
    "redis_restart": ("the batch's next result", "batch over"),
    "s3_pause_batch": ("the batch's next result", "batch over"),
    "s3_pause_finalize": ("batch over", "batch over"),
    "api_restart_upload": ("API answering", "upload checked, sweep done"),
    "postgres_restart": ("the batch's next result", "batch over"),
    "postgres_outage": ("the batch's next result", "batch over"),
    "postgres_restart_finalize": ("batch over", "batch over"),
}


def kind_order(rounds: int, rng: random.Random, kinds: Sequence[str]) -> list[str]:
    """``rounds`` kinds: each pass over ``kinds`` in a fresh seeded order, so every kind comes
    once before any comes twice."""
    order: list[str] = []
    while len(order) < rounds:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    return order[:rounds]


def _seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def kind_table(results: Sequence[RoundResult]) -> Table:
    table = Table(title="Faults and recovery (seconds from the fault's end: the kill, Redis back, S3 resumed)")
    for column in ("fault", "injected", "missed", "progress again: median / max", "measured to",
                   "over: median / max", "measured to"):
        table.add_column(column, justify="right" if column in ("injected", "missed") else "left")
    for kind in KINDS:
        faults = [f for r in results for f in r.faults if f.kind == kind]
        missed = sum(r.missed for r in results if r.kind == kind)
        if not faults and not missed:
            continue
        progress_to, over_to = MEASURED[kind]
        table.add_row(kind, str(len(faults)), str(missed),
                      _seconds([f.progress_s for f in faults if f.progress_s is not None]), progress_to,
                      _seconds([f.done_s for f in faults if f.done_s is not None]), over_to)
    return table


def totals(results: Sequence[RoundResult]) -> dict[str, int]:
    checks = [r.check for r in results if r.check is not None]
    return {
        "rounds": len(results),
        "faults injected": sum(len(r.faults) for r in results),
        "batches": len(results),
        "requests": sum(r.requests for r in results),
        "lost": sum(c.lost for c in checks),
        "duplicated": sum(c.duplicated for c in checks),
        "unexpected ids": sum(c.unexpected for c in checks),
        "stuck requests": sum(c.stuck for c in checks) + sum(r.leftovers.stuck_requests for r in results
                                                             if r.leftovers is not None),
        "live shards of finished batches": sum(r.leftovers.live_shards for r in results if r.leftovers is not None),
        "batches not terminal": sum(c.status not in BatchStatus.TERMINAL for c in checks) + sum(r.check is None for r in results),
        "usage/cost mismatches": sum(len(c.problems) for c in checks if c.status in BatchStatus.TERMINAL),
        "upload problems": sum(len(r.problems) for r in results if r.kind == "api_restart_upload"),
        "rounds not finished": sum(r.check is None for r in results),
    }


def api_table(results: Sequence[RoundResult]) -> Table:
    """What the API answered during each Postgres fault."""
    table = Table(title="The API during Postgres faults (polled every 0.1 s)")
    for column in ("round", "fault", "answers while the database was away", "slowest", "200 again after"):
        table.add_column(column)
    for result in results:
        for fault in result.faults:
            if fault.kind not in POSTGRES_KINDS or "statuses" not in fault.facts:
                continue
            facts = fault.facts
            answers = ", ".join(f"{n} x {status}" for status, n in sorted(facts["statuses"].items())) or "-"
            back = "never" if facts["back_s"] is None else f"{facts['back_s']:.2f} s"
            table.add_row(str(result.index + 1), fault.kind, answers, f"{facts['slowest_s']:.2f} s", back)
    return table


def totals_table(results: Sequence[RoundResult]) -> Table:
    table = Table(title="Totals")
    table.add_column("")
    table.add_column("", justify="right")
    for name, value in totals(results).items():
        table.add_row(name, str(value))
    return table


def failed(results: Sequence[RoundResult]) -> bool:
    return not results or any(not r.ok for r in results)


def round_line(result: RoundResult, rounds: int) -> str:
    faults = "; ".join(f.detail for f in result.faults) or "no fault (the batch passed the point first)"
    check = result.check
    outcome = "ok" if result.ok else "FAILED: " + "; ".join(
        result.problems + ([] if check is None else check.problems)
        + ([f"lost {check.lost} duplicated {check.duplicated} stuck {check.stuck}"] if check and not check.ok else [])
        + ([f"leftovers {result.leftovers}"] if result.leftovers and not result.leftovers.ok else []))
    status = check.status if check else "unfinished"
    return (f"round {result.index + 1}/{rounds} {result.kind}: {faults}; batch {status} after "
            f"{result.seconds:.1f}s: {outcome}")


def parse_settings(pairs: Sequence[str]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set {pair!r}: expected NAME=VALUE (a NIGHTSHIFT_ setting without the prefix)")
        settings[name.strip().lower()] = value
    return settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--requests", type=int, default=24, help="requests per batch")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="the longest request's tokens (they spread over 1..T; ignore_eos: each makes its own)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated: {', '.join(KINDS)}")
    p.add_argument("--engine-workers", type=int, default=2)
    p.add_argument("--shard-requests", type=int, default=4, help="NIGHTSHIFT_SHARD_MAX_REQUESTS")
    p.add_argument("--upload-mb", type=float, default=24.0, help="size of the upload the API is killed under")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a service setting for every process, e.g. --set lease_seconds=10")
    p.add_argument("--work", type=Path, help="keep the processes' logs in this folder")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds or args.rounds < 1 or args.requests < 2:
        raise SystemExit(f"--kinds: unknown {unknown}" if unknown else "need --rounds >= 1, --requests >= 2 and a kind")
    rng = random.Random(args.seed)
    settings = {"shard_max_requests": args.shard_requests,
                # The chaos sends the storage sweep itself, when no upload is running, so an upload
                # counts as abandoned after 5 s instead of 6 h (and moto dates every multipart upload
                # 2010: a sweep on beat could take one in progress for abandoned).
                "storage_sweep_interval_seconds": 7 * 24 * 3600, "abandoned_upload_seconds": 5,
                **parse_settings(args.set)}
    console = Console(width=160)
    order = kind_order(args.rounds, rng, kinds)
    results: list[RoundResult] = []
    started = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // args.engine_workers)
    with cluster(args.work, engine_workers=args.engine_workers, engine_threads=threads, keep_work=args.work is not None,
                 **settings) as running:
        console.print(f"chaos: {args.rounds} rounds, seed {args.seed}, {args.requests} requests x {args.max_tokens} "
                      f"tokens per batch, {args.engine_workers} engine workers ({threads} thread(s) each), "
                      f"settings {settings}; logs in {running.work}")
        chaos = Chaos(running, rng, requests=args.requests, max_tokens=args.max_tokens,
                      upload_bytes=int(args.upload_mb * 2 ** 20))
        try:
            console.print(f"warm-up batch (every engine worker loads its engine): {chaos.warm_up():.1f}s")
            chaos.start_schedule()
            for index, kind in enumerate(order):
                result = chaos.run_round(index, kind)
                results.append(result)
                console.print(round_line(result, args.rounds), highlight=False)
            schedule, schedule_problems = chaos.schedule_report()
        finally:
            chaos.close()
    console.print(f"\n{len(results)} rounds in {time.monotonic() - started:.0f}s")
    console.print(kind_table(results))
    if any(f.kind in POSTGRES_KINDS for r in results for f in r.faults):
        console.print(api_table(results))
    console.print(totals_table(results))
    console.print(f"schedule due every minute: {schedule['runs']} runs for {schedule['due_minutes']} due minutes, "
                  f"{schedule['duplicated']} fired twice, {schedule['missing']} never fired"
                  + ("" if not schedule_problems else "  FAILED: " + "; ".join(schedule_problems)))
    return 1 if failed(results) or schedule_problems else 0


if __name__ == "__main__":
    sys.exit(main())

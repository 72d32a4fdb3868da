"""The embedded default as a user meets it: `nightshift serve` (API + workers + beat on SQLite,
a local folder and the filesystem broker, no services), then `nightshift submit --wait`,
`status` and `results` from another process — the path scripts/demo.sh takes."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .api_fixtures import REPO, Service, free_port, service_env, wait_http


def nightshift(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "nightshift.api.cli", *args], env=env, cwd=REPO, capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        logs = Path(env["NIGHTSHIFT_HOME"]) / "logs"
        tails = {p.name: p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.log"))}
        raise AssertionError(f"`nightshift {' '.join(args)}` ran over {timeout}s; worker logs: {tails}") from None


def small_input(path, n: int = 4):  # noqa: ANN001, ANN201
    """The demo's file, cut short and with short answers, so the test stays quick on a CPU."""
    lines = [json.loads(x) for x in (REPO / "examples" / "batch.jsonl").read_text().splitlines()][:n]
    for line in lines:
        line["body"]["max_tokens"] = 8
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path, [x["custom_id"] for x in lines]


@pytest.mark.slow
def test_serve_submit_wait_results(tmp_path):
    input_path, expected = small_input(tmp_path / "input.jsonl")
    home = tmp_path / "home"
    port = free_port()
    env = service_env(home, port=port)
    service = Service(env, tmp_path)
    try:
        server = service.start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                         "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        assert (home / "api_key").is_file() and (home / "nightshift.db").is_file()

        submitted = nightshift(env, "submit", str(input_path), "--wait")
        assert submitted.returncode == 0, submitted.stderr.decode()[-3000:] + service.logs()
        batch_id = submitted.stdout.decode().strip()
        assert batch_id.startswith("batch_")
        assert "completed" in submitted.stderr.decode()

        status = json.loads(nightshift(env, "status", batch_id).stdout)
        assert status["status"] == "completed" and status["request_counts"]["completed"] == len(expected)

        results = nightshift(env, "results", batch_id)
        assert results.returncode == 0
        lines = [json.loads(x) for x in results.stdout.decode().splitlines()]
        assert [x["custom_id"] for x in lines] == expected          # each once, in input order
        assert all(x["response"]["status_code"] == 200 for x in lines)

        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n')
        failed = nightshift(env, "submit", str(bad), "--wait", "--quiet")
        assert failed.returncode == 1 and b"line 1: Only the POST method" in failed.stderr
        no_results = nightshift(env, "results", failed.stdout.decode().strip())
        assert no_results.returncode == 1 and b"is failed: no result files" in no_results.stderr
        nothing = nightshift(env, "retry", batch_id)                   # every line completed
        assert nothing.returncode == 1 and b"has no failed requests to retry" in nothing.stderr
        invalid = nightshift(env, "retry", failed.stdout.decode().strip(), "--code", "batch_expired")
        assert invalid.returncode == 1 and b"HTTP 409" in invalid.stderr \
            and b"no failed requests with error code batch_expired to retry (its input file failed validation" \
            in invalid.stderr

        new_key = nightshift(env, "keys", "create", "--project", "second")
        assert new_key.returncode == 0
        other = nightshift(env, "status", batch_id, "--api-key", new_key.stdout.decode().strip())
        assert other.returncode != 0 and b"404" in other.stderr   # another project's batch

        server.terminate()                      # SIGTERM to `serve` alone: it must stop its workers
        server.wait(60)
        assert wait_until(lambda: not processes_with_home(home), 30), processes_with_home(home)
    finally:
        service.stop()


def processes_with_home(home: Path) -> list[int]:
    """Live processes started with this NIGHTSHIFT_HOME (the server and its workers)."""
    marker = f"NIGHTSHIFT_HOME={home}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:
            pass
    return pids


def db_rows(home: Path, sql: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(home / "nightshift.db", timeout=30) as conn:
        return conn.execute(sql).fetchall()


def wait_until(predicate, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_sigterm_stops_serve_within_seconds_and_a_restart_finishes_the_batch(tmp_path):
    """SIGTERM mid-batch: `serve` and its workers are gone within a few seconds; the shard
    stopped midway keeps its rows pending, and after a restart the reconciler re-runs it, so
    every custom_id is answered exactly once."""
    input_path, expected = small_input(tmp_path / "input.jsonl", n=12)
    lines = [json.loads(x) for x in input_path.read_text().splitlines()]
    for line in lines:
        line["body"]["max_tokens"] = 256      # seconds of work on any CPU: still running 2 s in
        line["body"]["ignore_eos"] = True
    input_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    home = tmp_path / "home"
    port = free_port()
    # Short leases so the restarted service does not wait two minutes for the old one to run out.
    env = service_env(home, port=port, lease_seconds=6, heartbeat_seconds=1, reconcile_interval_seconds=2,
                      requeue_pending_after_seconds=5)
    service = Service(env, tmp_path)
    argv = [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port), "--log-level", "warning"]
    try:
        server = service.start("serve", argv)
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        batch_id = nightshift(env, "submit", str(input_path)).stdout.decode().strip()
        assert wait_until(lambda: db_rows(home, "SELECT status FROM shards") == [("running",)], 120)
        time.sleep(2)   # the engine is generating now

        started = time.monotonic()
        server.terminate()
        server.wait(30)
        assert wait_until(lambda: not processes_with_home(home), 15), processes_with_home(home)
        stopped_after = time.monotonic() - started
        assert stopped_after < 8, f"serve and its workers took {stopped_after:.1f}s to stop"
        # Stopped midway: the shard was handed back (or still holds its lease), requests unanswered.
        assert db_rows(home, "SELECT status FROM shards")[0][0] in ("pending", "running")
        assert db_rows(home, "SELECT count(*) FROM requests WHERE status = 'pending'")[0][0] > 0

        server = service.start("serve-again", argv)
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        assert wait_until(lambda: json.loads(nightshift(env, "status", batch_id).stdout)["status"] == "completed",
                          300), service.logs()
        results = [json.loads(x) for x in nightshift(env, "results", batch_id).stdout.decode().splitlines()]
        assert sorted(x["custom_id"] for x in results) == sorted(expected)
        assert all(x["response"]["status_code"] == 200 for x in results)
    finally:
        service.stop()

"""Secrets never reach a log: a full job through `nightshift serve` (API, the three workers and
beat; objects in S3 through moto's server), configured with a bootstrap API key and an S3
secret key. Afterwards neither secret appears in any log file under the home, in the server's
own output, or in what the CLI printed."""
from __future__ import annotations

import json
import sys
import uuid

import pytest

from .api_fixtures import Service, free_port, new_bucket, s3_env, service_env, wait_http
from .test_cli_embedded import nightshift, small_input


@pytest.mark.slow
def test_a_full_job_logs_neither_the_api_key_nor_the_s3_secret(s3_server, tmp_path):
    api_key = "ns-secret-" + uuid.uuid4().hex
    s3_secret = "s3-secret-" + uuid.uuid4().hex
    home = tmp_path / "home"
    port = free_port()
    env = service_env(home, port=port, bootstrap_key=api_key,
                      **{**s3_env(s3_server, new_bucket(s3_server)), "s3_secret_access_key": s3_secret})
    input_path, expected = small_input(tmp_path / "input.jsonl", n=2)
    service = Service(env, tmp_path)
    printed = []
    try:
        server = service.start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port)])
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        submitted = nightshift(env, "submit", str(input_path), "--wait", "--quiet")
        printed.append(submitted)
        assert submitted.returncode == 0, submitted.stderr.decode()[-3000:] + service.logs()
        batch_id = submitted.stdout.decode().strip()
        results = nightshift(env, "results", batch_id)
        printed += [results, nightshift(env, "status", batch_id), nightshift(env, "keys", "list"),
                    nightshift(env, "status", batch_id, "--api-key", api_key + "x")]   # a wrong key is echoed masked
        assert [json.loads(x)["custom_id"] for x in results.stdout.decode().splitlines()] == expected
        server.terminate()
        server.wait(60)
    finally:
        service.stop()
    logs = sorted(home.rglob("*.log")) + [tmp_path / "serve.log"]
    assert {p.name for p in logs} >= {"gpu.log", "cpu.log", "upkeep.log", "serve.log"}
    assert all(p.stat().st_size > 0 for p in logs)
    assert b"nightshift.run_shard" in (home / "logs" / "gpu.log").read_bytes()   # the workers' INFO lines are here
    texts = {str(p): p.read_bytes() for p in logs}
    texts.update({f"cli output {i}": run.stdout + run.stderr for i, run in enumerate(printed)})
    for secret in (api_key, s3_secret):
        for fragment in (secret, secret[-16:]):     # whole, or the random part of it
            leaks = [where for where, text in texts.items() if fragment.encode() in text]
            assert not leaks, f"{fragment!r} appears in {leaks}"
    assert b"Incorrect API key provided" in printed[-1].stderr      # the refusal itself was printed
    assert not (home / "api_key").exists()                           # a configured key is not written out either

"""bench.api_load end to end on the embedded service, at a tiny size: it starts the service,
polls, uploads, times a larger upload to in_progress, and reports no errors."""
from __future__ import annotations

import re

import pytest

from bench import api_load


def test_report_counts_503_apart_from_errors():
    samples = api_load.Samples()
    for ms in (1, 2, 3, 4):
        samples.add("GET x", ms / 1000, "200")
    samples.add("GET x", 0.01, "503")
    samples.add("GET x", 30.0, "ReadTimeout")
    table = api_load.report(samples, seconds=2.0).splitlines()
    assert table[1].split()[:4] == ["GET", "x", "4", "2.0"]          # 4 answered, 2 per second
    assert table[1].endswith("     1 1 {'ReadTimeout': 1}")                 # one 503, one error


def test_server_latency_line_reads_the_window_from_histogram_buckets():
    inf = float("inf")
    before = {0.01: 10.0, 0.05: 10.0, 0.1: 10.0, inf: 10.0}
    after = {0.01: 900.0, 0.05: 1005.0, 0.1: 1010.0, inf: 1010.0}    # 1000 in the window, 5 over 50 ms
    assert api_load.server_latency_line(before, after).endswith(
        "1000 GET batch, 99.50% answered within 50 ms, p99 <= 50 ms")
    assert "no GET batch" in api_load.server_latency_line(before, before)


@pytest.mark.slow
def test_small_run_against_embedded_service(capsys):
    samples = api_load.run(api_load.argparse.Namespace(
        shape="embedded", clients=6, seconds=2.0, interval=0.1, uploads=2, upload_lines=10, big_file_lines=200,
        batch_requests=0, processes=2, hammer=0, polite_clients=0,
        slow_readers=2, reader_kbps=100, reader_file_mb=0.5, consoles=0, console_interval=3.0, console_rounds=2))
    out = capsys.readouterr().out
    assert samples.errors == {}
    assert len(samples.latencies["GET /v1/batches/{id}"]) > 10
    assert len(samples.latencies["POST /v1/files (10 lines)"]) == 2
    # the server's own histogram timed exactly the polls the clients made in the window
    assert f"(the API's /metrics histogram): {len(samples.latencies['GET /v1/batches/{id}'])} GET batch" in out
    assert "CPU seconds in the window" in out and "API " in out
    slow = samples.latencies["GET /v1/files/{id}/content (slow)"]
    assert len(slow) == 2 and "2 slow readers of a 0.5 MB file" in out      # each still reading at the end
    assert "200-line file" in out and "batch in_progress" in out


@pytest.mark.slow
def test_consoles_run_measures_the_api_without_and_with_open_consoles(capsys):
    windows = api_load.run(api_load.argparse.Namespace(
        shape="embedded", clients=4, seconds=1.5, interval=0.2, uploads=0, upload_lines=10, big_file_lines=0,
        batch_requests=0, processes=1, hammer=0, polite_clients=0, slow_readers=0, reader_kbps=100,
        reader_file_mb=0.5, consoles=3, console_interval=0.25, console_rounds=2))
    out = capsys.readouterr().out
    assert set(windows) == {"without", "with"}
    assert all(w.errors == {} and w.overloaded == {} for w in windows.values())
    assert api_load.CONSOLE_POLL not in windows["without"].latencies            # consoles only in their windows
    polls = windows["with"].latencies[api_load.CONSOLE_POLL]
    assert 3 * 2 * 3 <= len(polls) <= 3 * 2 * 7        # 3 consoles, 2 windows of 1.5 s, one poll each 0.25 s
    assert len(windows["without"].latencies["GET /v1/batches/{id}"]) > 10
    assert "3 consoles logged in" in out and "with 3 consoles polling every 0.25s; errors 0" in out
    assert re.search(r"p99: [\d.]+ ms without consoles, [\d.]+ ms with 3 consoles", out)

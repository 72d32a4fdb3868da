"""bench.chaos's checks and report, without a cluster: the invariants catch a duplicated or lost
line and a usage total that does not add up (a batch finalized for real on SQLite and a local
folder, then tampered with); the tables add up the rounds; any failed promise fails the run.
(The rounds themselves run against real processes in tests/service/test_faults.py.)"""
from __future__ import annotations

import random
import time

import orjson
import pytest
from rich.console import Console

from bench import chaos
from bench.chaos_faults import KINDS, Fault, RoundResult, chat_lines
from bench.invariants import BatchCheck, StoreHygiene, check_batch, count_ids, database_leftovers
from nightshift.jobs.batches.leases import RequestResult, claim_shard, complete_shard, pending_requests, write_results
from nightshift.jobs.batches.lifecycle import start_finalize_if_done
from nightshift.jobs.batches.models import Batch, RequestStatus
from nightshift.jobs.files.models import File
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.localdir import LocalDirStore
from nightshift.workers.finalize import finalize_batch
from tests.service.factories import in_transaction, make_running_batch


def answer(row_id: int) -> RequestResult:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    return RequestResult(row_id, RequestStatus.COMPLETED, response_status_code=200,
                         response_body={"choices": [{"message": {"content": "ok"}}], "usage": usage},
                         finish_reason="stop", prompt_tokens=3, cached_tokens=1, completion_tokens=2,
                         engine_seconds=0.25, finished_at=time.time())


@pytest.fixture
def finished_batch(tmp_path):
    from nightshift.migrations import upgrade_head

    url = f"sqlite:///{tmp_path / 'nightshift.db'}"
    upgrade_head(url)
    store = LocalDirStore(tmp_path / "objects")
    bid, shards = make_running_batch(url, store, 4, 2)
    for shard in shards:
        lease = in_transaction(url, claim_shard, shard, "w", 30, device="cpu")
        in_transaction(url, write_results, lease, [answer(r.id) for r in in_transaction(url, pending_requests, lease)],
                       30, device="cpu")
        assert in_transaction(url, complete_shard, lease)
    with session_scope(url) as s:
        assert start_finalize_if_done(s, bid)
    settings = Settings(database_url=url, storage_dir=tmp_path / "objects")
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"
    return url, store, bid


def test_a_finalized_batch_keeps_every_promise(finished_batch):
    url, store, bid = finished_batch
    check = check_batch(url, store, bid, [f"req-{i}" for i in range(4)])
    assert check.ok and check.status == "completed", check
    assert database_leftovers(url).ok


def test_a_duplicated_line_and_a_lost_one_are_caught(finished_batch):
    url, store, bid = finished_batch
    with session_scope(url) as s:
        key = s.get(File, s.get(Batch, bid).output_file_id).object_key
    lines = b"".join(store.get_stream(key)).splitlines()
    store.put_stream(key, b"\n".join([lines[0], lines[0], lines[1], lines[2]]) + b"\n")     # req-3 lost, req-0 twice
    check = check_batch(url, store, bid, [f"req-{i}" for i in range(4)])
    assert (check.lost, check.duplicated, check.unexpected) == (1, 1, 0)
    assert not check.ok and check.problems == []      # the counts still add up: 4 lines, 4 requests


def test_usage_that_does_not_add_up_is_caught(finished_batch):
    url, store, bid = finished_batch
    with session_scope(url) as s:
        key = s.get(File, s.get(Batch, bid).output_file_id).object_key
    lines = [orjson.loads(x) for x in b"".join(store.get_stream(key)).splitlines()]
    lines[0]["response"]["body"]["usage"]["completion_tokens"] += 1
    store.put_stream(key, b"".join(orjson.dumps(x) + b"\n" for x in lines))
    check = check_batch(url, store, bid, [f"req-{i}" for i in range(4)])
    assert (check.lost, check.duplicated) == (0, 0) and not check.ok
    assert any("the lines' (4, 4, 0, 12, 4, 9)" in p for p in check.problems), check.problems
    assert any("cost report tokens" in p for p in check.problems), check.problems


def test_a_batch_that_never_ended_is_reported_not_terminal(tmp_path):
    from nightshift.migrations import upgrade_head

    url = f"sqlite:///{tmp_path / 'nightshift.db'}"
    upgrade_head(url)
    store = LocalDirStore(tmp_path / "objects")
    bid, _ = make_running_batch(url, store, 3, 1)
    check = check_batch(url, store, bid, ["req-0", "req-1", "req-2"])
    assert check.stuck == 3 and check.problems == ["status 'in_progress' is not terminal"]
    assert database_leftovers(url).unfinished_batches == [bid]


def test_count_ids():
    assert count_ids(["a", "b", "c"], ["a", "a", "a", "b", "x"]) == (1, 2, 1)


def test_every_kind_comes_once_before_any_comes_twice():
    k = len(KINDS)
    order = chaos.kind_order(2 * k + 3, random.Random(5), KINDS)
    assert len(order) == 2 * k + 3 and sorted(order[:k]) == sorted(KINDS) and sorted(order[k:2 * k]) == sorted(KINDS)
    assert order != chaos.kind_order(2 * k + 3, random.Random(6), KINDS)


def test_chat_lines_spread_their_lengths():
    lines = [orjson.loads(x) for x in chat_lines(16, 16, "r0").splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r0-{i}" for i in range(16)]
    assert sorted(x["body"]["max_tokens"] for x in lines) == list(range(1, 17))


def result(index: int, kind: str, faults: list[Fault], *, lost: int = 0, duplicated: int = 0,
           problems: list[str] | None = None) -> RoundResult:
    check = BatchCheck(f"batch_{index}", "completed", 24, lost=lost, duplicated=duplicated)
    return RoundResult(index, kind, f"batch_{index}", 24, faults, 0, check, StoreHygiene(0, 0, []), problems or [],
                       30.0)


def row(text: str, name: str) -> list[str]:
    """The cells of the table row whose first cell is ``name``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in\n{text}")


def test_the_tables_add_up_the_rounds():
    results = [
        result(0, "engine_kill", [Fault("engine_kill", "engine1 held shard 2 at 1/4", 0.0, 31.0, 35.0),
                                  Fault("engine_kill", "engine2 held shard 3 at 0/4", 0.0, 33.0, 40.0)]),
        result(1, "engine_kill", [Fault("engine_kill", "engine1 held shard 1 at 2/4", 0.0, 35.0, 36.0)]),
        result(2, "redis_restart", [Fault("redis_restart", "broker restarted", 0.0, 0.5, 4.0)]),
    ]
    console = Console(record=True, width=250)
    console.print(chaos.kind_table(results))
    console.print(chaos.totals_table(results))
    text = console.export_text()
    assert row(text, "engine_kill")[1:6] == ["3", "0", "33.0 / 35.0", "the killed shard's next result", "36.0 / 40.0"]
    assert row(text, "redis_restart")[1:4] == ["1", "0", "0.5 / 0.5"]
    assert "s3_pause_batch" not in text                                   # no round of that kind
    assert row(text, "rounds")[1] == "3" and row(text, "faults injected")[1] == "4"
    assert row(text, "requests")[1] == "72" and row(text, "lost")[1] == "0" and row(text, "duplicated")[1] == "0"
    assert not chaos.failed(results)


def test_any_broken_promise_fails_the_run():
    fine = result(0, "redis_restart", [Fault("redis_restart", "x", 0.0, 1.0, 2.0)])
    assert chaos.failed([fine, result(1, "engine_kill", [], duplicated=1)])
    assert chaos.failed([fine, result(1, "api_restart_upload", [], problems=["objects without a file row: [...]"])])
    leaked = result(2, "redis_restart", [])
    leaked.leftovers = StoreHygiene(2, 0, [])
    assert chaos.failed([fine, leaked])
    assert chaos.totals([fine, leaked])["stuck requests"] == 2
    assert chaos.failed([])
    assert "FAILED: lost 0 duplicated 1 stuck 0" in chaos.round_line(result(1, "engine_kill", [], duplicated=1), 2)


def test_settings_must_be_name_value():
    assert chaos.parse_settings(["lease_seconds=10", "S3_MAX_ATTEMPTS=2"]) == {"lease_seconds": "10",
                                                                            "s3_max_attempts": "2"}
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        chaos.parse_settings(["lease_seconds"])

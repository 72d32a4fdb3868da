"""bench.pipeline's report: the best batch against the best engine-only run, with that batch's
profile, and every run's time listed."""
from __future__ import annotations

from bench import pipeline


def _run(seconds: float, shards: int) -> pipeline.PipelineRun:
    return pipeline.PipelineRun("completed", seconds, shards, {"ingest": seconds / 10}, {"writes": 0.1, "shards": 2})


def test_report_compares_the_best_runs_of_each_side():
    text = pipeline.report([_run(3.0, 18), _run(2.5, 17), _run(2.8, 18)], engine_seconds=2.0, requests=1000,
                           mode="embedded")
    lines = text.splitlines()
    assert lines[0] == ("pipeline (embedded): completed in best 2.50s of 3.00, 2.50, 2.80s over 17 shard(s); "
                        "the best run's profile:")
    assert "0.250s" in lines[1]                                       # the best run's phases
    assert lines[-1].startswith("overhead vs engine only: +0.50s = +25.0% = +0.500 ms per request")


def test_one_run_is_reported_plainly():
    assert pipeline._runs([1.234]) == "1.23s"
    assert pipeline._runs([1.5, 1.25]) == "best 1.25s of 1.50, 1.25s"

"""bench.pipeline's report: the best batch against the best engine-only run, with that batch's
profile, and every run's time listed."""
from __future__ import annotations

from bench import pipeline


def _run(seconds: float, shards: int) -> pipeline.PipelineRun:
    return pipeline.PipelineRun("completed", seconds, shards, {"ingest": seconds / 10},
                                {"writes": 0.1, "shards": 2, "step_seconds": 1.5, "steps": 40})


def test_report_compares_the_best_runs_of_each_side():
    text = pipeline.report([_run(3.0, 18), _run(2.5, 17), _run(2.8, 18)], engine_seconds=2.0, requests=1000,
                           mode="embedded")
    lines = text.splitlines()
    assert lines[0] == ("pipeline (embedded): completed in best 2.50s of 3.00, 2.50, 2.80s over 17 shard(s); "
                        "the best run's profile:")
    assert "0.250s" in lines[1]                                       # the best run's phases
    assert any(line.split() == ["step_seconds", "1.500s"] for line in lines)   # the engine's steps, of generate
    assert any(line.split() == ["steps", "40.000"] for line in lines)          # a count, no unit
    assert lines[-1].startswith("overhead vs engine only: +0.50s = +25.0% = +0.500 ms per request")


def test_one_run_is_reported_plainly():
    assert pipeline._runs([1.234]) == "1.23s"
    assert pipeline._runs([1.5, 1.25]) == "best 1.25s of 1.50, 1.25s"


def test_engine_only_side_warms_up_on_the_whole_set_and_takes_a_saved_tokenizer(tmp_path, monkeypatch):
    """The engine-only side runs every request once untimed before its timed runs (on a GPU a step size
    met for the first time stalls while the INT4 kernels are measured); --dummy-weights writes the
    tokenizer it is given (a folder saved by Tokenizer.save, as carried to a GPU machine)."""
    from bench.dummy_weights import save_hf_folder
    from nightshift.engine import Engine
    from nightshift.engine.tokenizer import load_tokenizer

    load_tokenizer("default").save(tmp_path / "tokenizer")
    folder = save_hf_folder("llama-tiny", tmp_path / "model", tokenizer=str(tmp_path / "tokenizer"))
    assert load_tokenizer(str(folder)).vocab_size == load_tokenizer("default").vocab_size
    engines = []
    real = Engine.from_pretrained.__func__

    def keep(cls, *args, **kwargs):
        engines.append(real(cls, *args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(keep))
    runs, tokens = pipeline.engine_only_seconds(pipeline.request_lines(6, 4), str(folder), None, repeats=2)
    assert len(runs) == 2 and all(seconds > 0 for seconds in runs) and tokens == 6 * 4
    assert engines[0].stats().requests_finished == 6 * 3      # the warm-up pass and the two timed runs

"""bench.engine: the workload it builds, its HF baseline model, and the command end to end."""

import pytest
import torch

from bench import engine as bench
from nightshift.engine.tokenizer import load_tokenizer


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_bench(*args: str):
    """bench.engine's whole run on the test's own torch threads: (report, the lines it logged)."""
    lines = []
    report = bench.run(bench.parse_args([*args, "--threads", str(torch.get_num_threads())]), log=lines.append)
    return report, lines


def test_workload_has_one_shared_system_prompt_and_unique_user_turns():
    tokenizer = load_tokenizer("default")
    prompts = bench.build_workload(tokenizer, 24, seed=0)
    assert len(prompts) == 24 and len({tuple(p) for p in prompts}) == 24
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert 200 <= shared <= 240                           # ~200-token system prompt (+ template)
    tails = [len(p) - shared for p in prompts]
    assert min(tails) >= 20 and max(tails) <= 60 + 12     # 20-60-token user turn (+ template)
    assert bench.build_workload(tokenizer, 24, seed=0) == prompts   # fixed workload


@pytest.mark.slow
def test_hf_baseline_model_has_the_same_weights_as_transformers_gguf_load(hf_reference_model):
    ours = bench.hf_model_from_cache("default", torch.float32)
    ids = torch.tensor([load_tokenizer("default").encode("The quick brown fox jumps over the lazy dog.")])
    with torch.inference_mode():
        assert torch.allclose(ours(ids).logits, hf_reference_model(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bench_command_reports_engine_floor_and_hf():
    report, lines = run_bench("--num-requests", "3", "--output-len", "3", "--hf-batch-sizes", "1,2")
    result = report.engine
    assert result.output_tokens == 9 and len(report.prompt_lengths) == 3 and report.output_len == 3
    assert result.prompt_tokens == sum(report.prompt_lengths) and result.seconds > 0
    assert len(result.ttft) == 3 and len(result.tpot) == 3 and report.roofline is None   # CPU, no peaks given
    # 3 requests x 3 tokens: 9 rows with logits at 3-row steps, the uncached prompt rows but one per
    # request without the LM head
    floor = report.floor
    assert (floor.logits_rows, floor.decode_rows) == (9, 3) and floor.seconds > 0
    assert floor.other_rows == result.prompt_tokens - result.cached_tokens - 3
    assert [(r.batch_size, r.requests, r.output_tokens) for r in report.peers] == [(1, 1, 3), (2, 2, 6)]
    assert report.ratio == pytest.approx(result.output_tps / max(r.output_tps for r in report.peers))
    assert any("== nightshift engine ==" in line for line in lines)     # sections are logged as they finish
    assert any(line.startswith("5x the fastest peer") for line in lines)
    assert any(line.startswith("compute: cpu ") for line in lines)       # device, dtype and CPU math
    assert [r.system for r in report.peers] == ["HF float32"] * 2


@pytest.mark.slow
def test_breakdown_times_the_run_s_kernels_and_bounds_its_k_v_reads():
    report, lines = run_bench("--num-requests", "3", "--output-len", "4", "--skip-hf", "--breakdown")
    bound = report.breakdown
    assert bound is not None and bound.rate > 0 and bound.shared >= 192     # the ~200-token system prompt
    assert bound.bytes > bound.step_bytes > 0
    start = lines.index("\n== where the run's time went (wall time inside the CPU kernels' calls) ==")
    kinds = [line.split("  ")[0] for line in lines[start + 1:] if not line.startswith(("K/V", "so the"))]
    assert "linear layers and LM head" in kinds and kinds[-1] == "the rest"
    assert any(line.startswith("K/V reads: the decode steps read") for line in lines)
    assert any(line.startswith("so the matmul floor can be at most") for line in lines)


@pytest.mark.slow
def test_structured_run_makes_the_same_tokens_under_the_schema():
    report, lines = run_bench("--num-requests", "3", "--output-len", "24", "--skip-hf", "--structured",
                              "--repeats", "2")
    assert report.structured.output_tokens == report.engine.output_tokens == 3 * 24   # every answer ran to length
    assert report.structured.prompt_tokens == report.engine.prompt_tokens
    assert report.structured.cached_tokens == report.engine.cached_tokens              # both from an empty cache
    assert any("of the unconstrained run's" in line for line in lines)
    alternating = next(line for line in lines if line.startswith("output tok/s, runs alternating"))
    assert alternating.count(",") == 3            # "tok/s," and two runs of each side


def test_structured_schema_compiles_and_forces_long_answers():
    import jsonschema
    jsonschema.Draft202012Validator.check_schema(bench.STRUCTURED_SCHEMA)
    assert bench.STRUCTURED_SCHEMA["properties"]["summary"]["minLength"] >= 2000

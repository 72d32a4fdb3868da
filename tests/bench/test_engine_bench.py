"""bench.engine: the workload it builds, its HF baseline model, and the command end to end."""
import os
import re

import pytest
import torch

from bench import engine as bench
from nightshift.engine.tokenizer import load_tokenizer


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


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
def test_bench_command_prints_the_report(capsys):
    bench.main(["--num-requests", "3", "--output-len", "3", "--hf-batch-sizes", "1,2",
                "--threads", str(min(2, os.cpu_count()))])
    out = capsys.readouterr().out
    for needle in ("== nightshift engine ==", "output tok/s", "total tok/s", "TTFT p50", "TPOT p50",
                   "prefix-hit rate", "batch   1:", "batch   2:", "ratio: engine output tok/s / best HF"):
        assert needle in out, needle
    # 3 requests x 3 tokens: 9 rows with logits, the uncached prompt rows but one per request without
    floor = re.search(r"matmul floor (\d+\.\d) s = \d+% of the run: .* on its (\d+) token rows \(9 with logits, "
                      r"at 3-row steps; the rest at \d+-row steps without the LM head\)", out)
    assert floor, out
    assert re.search(r"5x the best HF would be \d+\.\d output tok/s: this run in \d+\.\d s, against a matmul "
                     r"floor of " + re.escape(floor.group(1)) + " s", out)
    assert "3 requests" in out and "3 output tokens each" in out

"""The greedy-agreement rules of python -m bench.greedy_check (float32: equal to HF; 16-bit: drift
from HF float32 against HF's own 16-bit model), and the checks themselves on CPU against
transformers (a GPU session runs the same with --device cuda)."""
import pytest
import torch

from bench.greedy_check import (DriftResult, PromptResult, check, check_drift, compare, default_prompts, drift,
                                drift_passes, passes)


def logits_with_gaps(gaps):
    """Reference logits whose top-2 gap at position j is gaps[j] (argmax token 0)."""
    rows = torch.zeros(len(gaps), 5)
    rows[:, 0] = 10.0
    rows[:, 1] = 10.0 - torch.tensor(gaps)
    return rows


def test_equal_prompt():
    r = compare(0, [1, 2, 3], [1, 2, 3], logits_with_gaps([1, 1, 1]), 0.1)
    assert r.equal and r.ok


def test_divergence_after_a_near_tie_is_allowed_before_one_is_not():
    tie_first = compare(1, [1, 2, 9], [1, 2, 3], logits_with_gaps([1, 0.05, 1]), 0.1)
    assert (tie_first.first_mismatch, tie_first.first_near_tie, tie_first.ok) == (2, 1, True)
    tie_at = compare(2, [1, 9, 9], [1, 2, 3], logits_with_gaps([1, 0.05, 1]), 0.1)
    assert tie_at.ok                                   # the tied position itself may differ
    no_tie = compare(3, [1, 9, 3], [1, 2, 3], logits_with_gaps([1, 1, 0.01]), 0.1)
    assert (no_tie.first_mismatch, no_tie.first_near_tie, no_tie.ok) == (1, 2, False)
    with pytest.raises(ValueError, match="prompt 4: 2 tokens from the engine, 3 from the reference"):
        compare(4, [1, 2], [1, 2, 3], logits_with_gaps([1, 1, 1]), 0.1)


def test_pass_needs_the_equal_fraction_and_only_tie_divergences():
    equal = [PromptResult(i, None, None) for i in range(9)]
    assert passes(equal + [PromptResult(9, 4, 2)], 0.9)
    assert not passes(equal + [PromptResult(9, 4, None)], 0.9)            # diverged without a tie
    assert not passes(equal[:8] + [PromptResult(8, 4, 2), PromptResult(9, 4, 2)], 0.9)   # 80% equal


@pytest.mark.slow
def test_engine_matches_hf_on_cpu_float32(fp32_model):
    from bench.engine import hf_model_from_cache
    from nightshift.engine.engine import Engine
    from nightshift.engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer("default")
    prompts = default_prompts(tokenizer)
    assert len(prompts) == 18
    engine = Engine.from_model(fp32_model, tokenizer, "default", max_num_batched_tokens=48, num_kv_blocks=128)
    hf = hf_model_from_cache("default", torch.float32)
    chosen = [prompts[0], prompts[13]]                  # chat with the system prompt, code
    results = check(engine, hf, chosen, new_tokens=6, near_tie=1e-3)
    assert passes(results, 0.9), results


def test_drift_finds_the_first_difference_and_our_tokens_rank_there():
    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0], [0.0, 9.0, 8.0, 7.0], [1.0, 2.0, 3.0, 4.0]])
    r = drift(0, ours=[0, 3, 3], hf16=[0, 1, 2], reference=[0, 1, 3], reference_logits=logits)
    assert (r.ours, r.hf, r.rank) == (1, 2, 2)          # ours: token 3 where float32 ranks 1, 2, 3 first
    assert r.ok                                         # earlier than HF, but float32's third choice
    assert drift(1, [0, 1, 3], [0, 1, 3], [0, 1, 3], logits) == DriftResult(1, None, None, None)
    with pytest.raises(ValueError, match="2 tokens against a reference of 3"):
        drift(2, [0, 1], [0, 1, 3], [0, 1, 3], logits)


def test_drift_rule_per_prompt_and_over_the_set():
    assert DriftResult(0, None, 3, None).ok                          # equal in full
    assert DriftResult(0, 6, 4, 9).ok                                # later than HF: any rank
    assert DriftResult(0, 2, 4, 1).ok and not DriftResult(0, 2, 4, 5).ok   # earlier: float32's top 5 only
    assert not DriftResult(0, 2, None, 5).ok                         # HF equal, ours sixth-ranked
    same = [DriftResult(i, 10, 10, 1) for i in range(4)]
    assert drift_passes(same, 32)
    assert drift_passes(same + [DriftResult(4, 29, None, 1)], 32)     # 69 vs 72 agreeing: within 90%
    assert not drift_passes(same + [DriftResult(4, 0, None, 1)], 32)  # 40 vs 72: drifts earlier than HF
    assert not drift_passes([DriftResult(0, 12, 10, 7), DriftResult(1, 3, 8, 7)], 32)  # an implausible token


@pytest.mark.slow
def test_engine_bfloat16_first_differences_from_float32_are_plausible_on_cpu():
    from bench.engine import hf_model_from_cache
    from nightshift.engine.engine import Engine
    engine = Engine.from_pretrained("default", quantization="none", device="cpu", dtype=torch.bfloat16,
                                    max_num_batched_tokens=48, num_kv_blocks=128)
    prompts = default_prompts(engine.tokenizer)
    chosen = [prompts[0], prompts[9], prompts[13], prompts[16]]    # chat with and without the system prompt, code
    results = check_drift(engine, hf_model_from_cache("default", torch.float32),
                          hf_model_from_cache("default", torch.bfloat16), chosen, new_tokens=12)
    # per prompt only: over 4 x 12 tokens the summed drift is noise (38 vs HF's 34 on a Zen 5); the
    # command's 18 x 32 applies the whole rule. An MLP scaled by 1.2 put a token ranked 18th here.
    assert all(r.ok for r in results), results


def test_the_float32_rule_applies_only_to_float32_arithmetic():
    from types import SimpleNamespace
    from bench.greedy_check import exact_float32

    def engine(dtype, math):
        model = SimpleNamespace(dtype=dtype, cpu_math=None if math is None else SimpleNamespace(math=math))
        return SimpleNamespace(runner=SimpleNamespace(model=model))
    assert exact_float32(engine(torch.float32, None), "none")            # CUDA float32
    assert exact_float32(engine(torch.float32, "float32"), "none")       # CPU, float32 math
    assert not exact_float32(engine(torch.float32, "bf16"), "none")      # CPU float32 model multiplying in bf16
    assert not exact_float32(engine(torch.float32, None), "int4")
    assert not exact_float32(engine(torch.bfloat16, None), "none")

"""The greedy-agreement rule of python -m bench.greedy_check, and the check itself on CPU
float32 against transformers (a GPU session runs the same with --device cuda --dtype bfloat16)."""
import pytest
import torch

from bench.greedy_check import PromptResult, check, compare, default_prompts, passes


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

"""python -m bench.quality: fixed prompt set and a tiny end-to-end run on the real model."""
import pytest

from bench.quality import evaluate, quality_prompts


def test_prompt_set_is_fixed_and_large_enough():
    prompts = quality_prompts(64)
    assert len({p[0]["content"] for p in prompts}) == 64
    assert quality_prompts(64) == prompts
    with pytest.raises(ValueError, match="at most 64"):
        quality_prompts(65)


@pytest.mark.slow
def test_evaluate_gguf_import_dense_equals_full_precision():
    report = evaluate(num_prompts=2, new_tokens=3, variants=("gguf-import",), kernels=("dense",),
                      log=lambda *_: None)
    (result,) = report["comparisons"]
    assert result["positions"] == 6
    assert result["top1_agreement"] == 1.0 and result["greedy_exact_match"] == 1.0
    assert abs(result["mean_kl"]) < 1e-6
    size = report["checkpoint_sizes"]["gguf-import"]
    assert size["ratio_vs_bf16"] > 3.0 and size["group_sizes"] == [32]

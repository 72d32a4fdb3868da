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


@pytest.mark.slow
def test_evaluate_reports_the_w4a8_kernel_apart_from_the_dense_one():
    from nightshift.engine.quant import cpu_w4a8
    if not cpu_w4a8.available():
        pytest.skip("needs an x86 CPU with AVX2 and a C compiler")
    report = evaluate(num_prompts=2, new_tokens=3, variants=("gguf-import",), kernels=("dense", "w4a8"),
                      log=lambda *_: None)
    dense, w4a8 = report["comparisons"]
    assert (dense["kernel"], w4a8["kernel"]) == ("dense", "w4a8")
    assert abs(dense["mean_kl"]) < 1e-6 < w4a8["mean_kl"] < 0.1        # int8 activations move the logits a little
    assert w4a8["top1_agreement"] >= 0.5

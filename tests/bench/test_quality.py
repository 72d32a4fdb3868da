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


def test_shared_blocks_are_the_whole_blocks_of_the_prompts_common_start():
    from bench.quality import shared_blocks
    start = list(range(100, 140))                                   # 40 tokens: two whole blocks of 16
    assert shared_blocks([start + [1, 2], start + [3]], 16) == 2
    assert shared_blocks([start + [1, 2], start[:20] + [3]], 16) == 1
    assert shared_blocks([start, start + [5]], 16) == 2              # each keeps a token after them: 39 // 16
    assert shared_blocks([[1] + start, start], 16) == 0


@pytest.mark.slow
def test_a_shared_start_computed_once_gives_what_each_sequence_computes_alone(fp32_model):
    """bench.quality --shared-system's stepping: the common start's blocks prefilled once and read
    by every sequence give the same greedy tokens and log-probs as each sequence prefilling all of
    its prompt (the float32 math: every row alone)."""
    import torch

    from bench.quality import _Stepper
    g = torch.Generator().manual_seed(0)
    start = torch.randint(100, 40000, (40,), generator=g).tolist()
    prompts = [start + torch.randint(100, 40000, (n,), generator=g).tolist() for n in (3, 9, 17)]
    shared = _Stepper(fp32_model, prompts, 5, share_prefix=True)
    assert shared.shared == 32 and all(t[:2] == [0, 1] for t in shared.tables)
    tokens, logprobs = shared.run(5)
    alone_tokens, alone_logprobs = _Stepper(fp32_model, prompts, 5).run(5)
    assert tokens == alone_tokens
    torch.testing.assert_close(logprobs, alone_logprobs, rtol=0, atol=1e-4)

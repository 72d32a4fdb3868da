"""bench.engine with --dummy-weights (random Llama-shape weights, in our engine and in the HF
baseline) and the roofline lines (MBU/MFU; on CPU only with explicit peaks)."""
import torch

from bench import engine as bench
from bench.dummy_weights import DummyCheckpoint, build_dummy_model, dummy_config
from nightshift.engine.model_runner import ModelRunner, StepItem


def test_hf_baseline_gets_the_same_dummy_weights():
    config = dummy_config("llama-tiny")
    ours = ModelRunner(build_dummy_model("llama-tiny", seed=7), num_kv_blocks=4, block_size=16)
    hf = bench.hf_model_from_checkpoint(DummyCheckpoint(config, seed=7), torch.float32)
    prompt = [5, 900, 31, 4000, 77, 12]
    expected = ours.execute([StepItem(prompt, 0, [0])])[0]
    with torch.inference_mode():
        got = hf(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_bench_dummy_weights_reports_throughput_ratio_and_roofline():
    report = bench.run(bench.parse_args([
        "--dummy-weights", "llama-tiny", "--device", "cpu", "--num-requests", "3", "--output-len", "3",
        "--hf-batch-sizes", "1", "--threads", "1", "--peak-bandwidth", "50e9", "--peak-flops", "1e12",
        "--roofline-prefill-len", "64", "--kv-cache-gib", "0.01"]), log=lambda line: None)
    assert report.model_name == "dummy-llama-tiny" and report.engine.output_tokens == 9
    roofline = report.roofline
    assert roofline.device == "CPU" and roofline.peak.bandwidth == 50e9
    assert roofline.decode.tokens == 3 and roofline.decode.label.startswith("decode batch 3 ctx ")
    assert roofline.decode.utilisation > 0 and roofline.prefill.utilisation > 0
    assert (roofline.prefill.label, roofline.prefill.tokens) == ("prefill 1 x 64", 64)
    assert [r.batch_size for r in report.peers] == [1] and report.ratio > 0


def test_bench_dummy_weights_of_another_family_runs_its_folder_in_both(monkeypatch, tmp_path):
    """--dummy-weights olmoe-small: bench.random_hf_models writes the folder (here a tiny one of its
    layout) into a temporary directory, our engine and transformers' OlmoeForCausalLM both run it,
    and the folder is gone after the run."""
    from bench import random_hf_models

    config_class, model_class, fields = random_hf_models.SHAPES["olmoe-small"]
    tiny = {**fields, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    monkeypatch.setitem(random_hf_models.SHAPES, "olmoe-small", (config_class, model_class, tiny))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lines = []
    report = bench.run(bench.parse_args([
        "--dummy-weights", "olmoe-small", "--device", "cpu", "--num-requests", "3", "--output-len", "3",
        "--hf-batch-sizes", "1", "--threads", "1", "--kv-cache-gib", "0.01", "--peers", "hf-float32,ct2"]),
        log=lines.append)
    assert report.model_name == "olmoe-small" and report.engine.output_tokens == 9
    assert [(r.system, r.batch_size) for r in report.peers] == [("HF float32", 1)] and report.ratio > 0
    written = [line for line in lines if line.startswith("random weights: olmoe-small")]
    assert len(written) == 1 and f" in {tmp_path}/nightshift-olmoe-small-" in written[0]
    assert any("ct2: not run" in line for line in lines)
    assert list(tmp_path.iterdir()) == []       # the temporary folder removed


def test_bench_dummy_weights_names_the_known_shapes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.parse_args(["--dummy-weights", "gemma4-small"])
    err = capsys.readouterr().err
    assert "invalid choice: 'gemma4-small'" in err and "llama-8b" in err and "qwen3-moe-small" in err

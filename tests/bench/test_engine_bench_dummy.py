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

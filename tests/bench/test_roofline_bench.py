"""python -m bench.roofline_bench on a tiny random-weight model on CPU (the GPU run is the
same code with CUDA peaks)."""
import pytest
import torch

from bench.dummy_weights import build_dummy_model, dummy_config
from nightshift.engine.model_runner import ModelRunner
from bench.roofline import DevicePeak, kv_bytes_per_token, prefill_flops, weight_bytes_per_step
from bench.roofline_bench import measure_decode, measure_prefill, parse_args, run


def test_command_measures_decode_mbu_and_prefill_mfu():
    lines = []
    report = run(parse_args(["--dummy-weights", "llama-tiny", "--device", "cpu", "--quantization", "none",
                             "--batch-sizes", "1,3", "--context", "20", "--steps", "2", "--prefill-len", "24",
                             "--prefill-repeats", "1", "--peak-bandwidth", "50e9", "--peak-flops", "1e12"]),
                 log=lines.append)
    assert report.device == "CPU" and report.peak.bandwidth == 50e9 and report.peak.bf16_flops == 1e12
    assert report.kv_blocks == 3 * 2                      # batch 3 x 2 blocks of context 20 (> 24-token prefill)
    assert [(m.label, m.tokens) for m in report.decode] == [("decode batch 1 ctx 20", 1), ("decode batch 3 ctx 20", 3)]
    assert all(m.utilisation == pytest.approx(m.amount / m.seconds / 50e9) for m in report.decode)
    prefill = report.prefill
    assert (prefill.label, prefill.tokens) == ("prefill 1 x 24", 24)
    assert prefill.utilisation == pytest.approx(prefill_flops(dummy_config("llama-tiny"), [(0, 24)])
                                                / prefill.seconds / 1e12)
    assert len(lines) == 3 + 2 + 1                        # device, model, KV pool; one line per measurement


def test_decode_bytes_and_utilisation_follow_the_step():
    model = build_dummy_model("llama-tiny")
    runner = ModelRunner(model, num_kv_blocks=8, block_size=16)
    peak = DevicePeak("test", 1e9, 1e12)
    m = measure_decode(runner, batch=2, context=30, steps=1, peak=peak)
    assert m.amount == weight_bytes_per_step(model) + 2 * 30 * kv_bytes_per_token(model.config, torch.float32)
    assert m.utilisation == pytest.approx(m.amount / m.seconds / 1e9)
    p = measure_prefill(runner, prompts=1, length=16, repeats=1, peak=None)
    assert p.tokens == 16 and p.utilisation is None and "n/a" in p.line("GFLOP/s", "MFU")


def test_pool_too_small_is_a_clear_error():
    runner = ModelRunner(build_dummy_model("llama-tiny"), num_kv_blocks=3, block_size=16)
    with pytest.raises(ValueError, match="decode batch 2 x context 40 needs 6 KV blocks, the pool has 3"):
        measure_decode(runner, batch=2, context=40, steps=1, peak=None)

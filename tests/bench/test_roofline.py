"""Roofline arithmetic: device peaks by reported name, bytes per decode step, prefill FLOPs
(the matmul part checked against torch's FLOP counter on a real forward pass)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.dummy_weights import build_dummy_model, dummy_config
from nightshift.engine.attention import TorchAttention
from nightshift.engine.kv_cache import allocate_kv_caches, kv_bytes_per_block
from nightshift.engine.layers import cpu_gemm
from nightshift.engine.step import StepItem
from bench.roofline import (attention_flops, decode_step_bytes, device_peak, kv_bytes_per_token,
                             matmul_params_per_token, prefill_flops, utilisation, weight_bytes_per_step)


@pytest.mark.parametrize("reported, name, bandwidth", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2.0e12),
    ("NVIDIA H100 NVL", "H100 NVL", 3.9e12),
    ("NVIDIA H200", "H200 SXM", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 2.039e12),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1.555e12),
    ("NVIDIA L4", "L4", 300e9),
])
def test_device_peak_by_reported_name(reported, name, bandwidth):
    peak = device_peak(reported)
    assert (peak.name, peak.bandwidth) == (name, bandwidth)
    assert peak.bf16_flops > 1e14


def test_device_peak_unknown_needs_explicit_figures():
    with pytest.raises(ValueError, match="no peak figures for device 'Some CPU'"):
        device_peak("Some CPU")
    assert device_peak("Some CPU", bandwidth=50e9, bf16_flops=1e12).bandwidth == 50e9
    assert device_peak("NVIDIA H100 80GB HBM3", bandwidth=3e12).bandwidth == 3e12


def test_weight_bytes_tied_and_untied():
    tiny = build_dummy_model("llama-tiny")                   # tied: the embedding is the LM head
    c = tiny.config
    norms = (2 * c.num_layers + 1) * c.hidden_size
    assert weight_bytes_per_step(tiny) == 4 * (matmul_params_per_token(c) + norms + c.vocab_size * c.hidden_size)
    tiny.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)   # untied: embedding rows only
    assert weight_bytes_per_step(tiny) == 4 * (matmul_params_per_token(c) + norms + c.vocab_size * c.hidden_size)


def test_weight_bytes_int4_counts_packed_weights():
    from nightshift.engine.quant.config import QuantConfig
    dense = build_dummy_model("llama-tiny")
    int4 = build_dummy_model("llama-tiny", quant_config=QuantConfig())
    c = dense.config
    embedding = 4 * c.vocab_size * c.hidden_size          # tied LM head: stays float32 in both
    norms = 4 * (2 * c.num_layers + 1) * c.hidden_size
    dense_layers = weight_bytes_per_step(dense) - embedding - norms
    int4_layers = weight_bytes_per_step(int4) - embedding - norms
    assert dense_layers == 4 * matmul_params_per_token(c)
    # 4 bits + a float16 scale and min per group of 64/128 instead of 32 bits per weight
    assert dense_layers / 8 < int4_layers < dense_layers / 7


def test_kv_bytes_match_the_runner_pool():
    c = dummy_config("llama-8b")
    assert kv_bytes_per_token(c, torch.bfloat16) == 2 * 32 * 8 * 128 * 2       # 128 KiB per token
    assert kv_bytes_per_token(c, torch.bfloat16) * 16 == kv_bytes_per_block(c, 16, torch.bfloat16)
    assert decode_step_bytes(1000, 10, [3, 5]) == 1080


def test_prefill_flops_matmul_part_matches_torch_flop_counter(monkeypatch):
    # torch's FLOP counter sees aten matmuls, not oneDNN's packed linear: count on the plain path
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    model = build_dummy_model("llama-tiny")
    c = model.config
    n = 12
    attention = TorchAttention(c, 16, torch.float32, torch.device("cpu"))
    meta = attention.build_metadata([StepItem(list(range(n)), 0, [0])])    # one fresh prompt, one block
    caches = allocate_kv_caches(c, 4, 16, torch.float32, torch.device("cpu"))
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        model(torch.arange(n), torch.arange(n), caches, attention, meta, torch.tensor([n - 1]))
    counts = counter.get_flop_counts()["Global"]
    matmul = sum(v for op, v in counts.items() if "mm" in str(op))
    assert matmul == prefill_flops(c, [(0, n)]) - attention_flops(c, [(0, n)])


def test_attention_pairs_are_causal_after_the_cached_prefix():
    c = dummy_config("llama-tiny")
    per_pair = 4 * c.head_dim * c.num_heads * c.num_layers
    # 3 new tokens after 5 cached: they see 6, 7 and 8 positions
    assert attention_flops(c, [(5, 3)]) == per_pair * (6 + 7 + 8)
    assert attention_flops(c, [(0, 2), (1, 1)]) == per_pair * (1 + 2 + 2)


def test_utilisation():
    assert utilisation(3.35e12, 2.0, 3.35e12) == 0.5
    with pytest.raises(ValueError):
        utilisation(1.0, 0.0, 1.0)

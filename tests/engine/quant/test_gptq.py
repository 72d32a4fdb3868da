"""GPTQ and the RTN grid search: they lower the layer's error where they should, and GPTQ
degenerates to plain RTN when the calibration inputs are uncorrelated and even."""
import pytest
import torch

from nightshift.engine.layers.linear import WeightSource
from nightshift.engine.quant.activation_stats import ActivationStats
from nightshift.engine.quant.cache import QuantizedCheckpointCache, cache_file
from nightshift.engine.quant.config import QuantConfig
from nightshift.engine.quant.format import quantize_rtn, search_group_grid
from nightshift.engine.quant.gptq import quantize_awq_gptq, quantize_gptq
from nightshift.engine.quant.linear_factory import Int4LinearFactory


def _correlated_activations(rows, k=256, seed=0):
    """LLM-like inputs: a few outlier channels and strong correlation between channels."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(0)) / k ** 0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) @ mix
    x[:, :6] *= 20.0
    return x


def _stats(x):
    xd = x.double()
    return ActivationStats(x.abs().mean(0), x[:512], xd.t() @ xd, x.shape[0])


def test_gptq_lowers_output_error_on_held_out_rows():
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.05
    calib, held_out = _correlated_activations(1024), _correlated_activations(512, seed=7)
    reference = held_out @ w.t()
    rtn = quantize_rtn(w, 64)

    def err(q):
        return (held_out @ q.dequantize().t() - reference).pow(2).mean()

    # plenty of calibration rows (4 per input): light damping pays, both column orders work
    assert err(quantize_gptq(w, _stats(calib), 64, damp=0.01, act_order=False)) < 0.4 * err(rtn)
    assert err(quantize_gptq(w, _stats(calib), 64, damp=0.01, act_order=True)) < 0.4 * err(rtn)
    default = quantize_gptq(w, _stats(calib), 64)   # damped for the real model's scarce rows
    assert err(default) < 0.85 * err(rtn)
    assert default.scales.shape == rtn.scales.shape and default.qweight.dtype == torch.uint8


def test_gptq_with_identity_hessian_is_rtn():
    # H = I: no error is propagated (H^-1 is diagonal), every group is searched on its own weights
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.05
    stats = ActivationStats(torch.ones(256), torch.eye(256), torch.eye(256, dtype=torch.float64) * 100, 100)
    assert torch.equal(quantize_gptq(w, stats, 128).dequantize(), quantize_rtn(w, 128).dequantize())


def test_awq_gptq_applies_its_scale_and_beats_rtn():
    # salient channels (large, uncorrelated with the rest) plus correlated inputs
    torch.manual_seed(3)
    w = torch.randn(128, 256) * 0.05
    calib, held_out = _correlated_activations(1024), _correlated_activations(512, seed=7)
    reference = held_out @ w.t()
    q, input_scale = quantize_awq_gptq(w, _stats(calib), 64)
    assert input_scale.shape == (256,) and not torch.allclose(input_scale, torch.ones(256))
    combined = (held_out * input_scale @ q.dequantize().t() - reference).pow(2).mean()
    rtn = (held_out @ quantize_rtn(w, 64).dequantize().t() - reference).pow(2).mean()
    assert combined < 0.85 * rtn


def test_gptq_needs_hessian():
    with pytest.raises(ValueError, match="x\\^T x"):
        quantize_gptq(torch.randn(8, 64), ActivationStats(torch.ones(64), torch.randn(4, 64)), 32)


def test_asymmetric_clip_and_refit_beat_symmetric_clip():
    # groups with a one-sided outlier: shrinking only the top end pays, a symmetric shrink cannot
    torch.manual_seed(2)
    w = torch.randn(256, 1, 64) * 0.05
    w[:, 0, 0] = 0.4
    q, scales, mins = search_group_grid(w)
    searched = (q * scales.float() + mins.float() - w).pow(2).sum()
    from nightshift.engine.quant.format import CLIP_RATIOS, _Candidate
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    symmetric = _Candidate(w, lo, hi)
    for ratio in CLIP_RATIOS[1:]:
        symmetric.keep_better(_Candidate(w, lo * ratio, hi * ratio))
    assert searched < 0.9 * symmetric.err.sum()
    assert (q == q.round()).all() and q.min() >= 0 and q.max() <= 15


@pytest.mark.parametrize("method", ["gptq", "awq-gptq"])
def test_gptq_method_through_config_and_cache(tmp_path, method):
    x = _correlated_activations(512, k=128)
    w = torch.randn(32, 128) * 0.05
    name = "model.layers.0.self_attn.o_proj"
    source = WeightSource(name=name, parts=["w"], tensor=lambda n: w if n == "w.weight" else None,
                          gguf=lambda n: None, dtype=torch.float32, device=torch.device("cpu"))
    config = QuantConfig(method=method, group_size=64)
    assert config.needs_calibration and config.cache_tag() != QuantConfig(group_size=64).cache_tag()
    calls = []

    def calibrate():
        calls.append(1)
        return {name: _stats(x)}

    path = cache_file(tmp_path, "b" * 64, config)
    cache = QuantizedCheckpointCache(path)
    first = Int4LinearFactory(config, cache, calibrate)(source)
    cache.save_if_changed()
    second = Int4LinearFactory(config, QuantizedCheckpointCache(path), calibrate)(source)
    assert calls == [1]
    assert torch.equal(first.qweight, second.qweight)
    assert (first.input_scale is not None) == (method == "awq-gptq")
    rtn = Int4LinearFactory(QuantConfig(group_size=64))(source)
    first.cpu_int4_max_rows = rtn.cpu_int4_max_rows = 0
    reference = x @ w.t()
    assert (first(x) - reference).pow(2).mean() < (rtn(x) - reference).pow(2).mean()
    with pytest.raises(ValueError, match="needs calibration activations"):
        Int4LinearFactory(config)(source)
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantConfig(method="hqq")

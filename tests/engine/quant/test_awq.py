"""AWQ-style activation-aware scaling: it lowers the output error where activations are uneven,
and Int4Linear applies its activation multiplier."""
import torch
import torch.nn.functional as F
from torch import nn

from nightshift.engine.layers.linear import DenseLinear
from nightshift.engine.quant.awq import quantize_awq
from nightshift.engine.quant.activation_stats import ActivationStats, collect_activation_stats
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.quant.int4_linear import Int4Linear


def _uneven_activations(rows=256, k=256):
    torch.manual_seed(0)
    x = torch.randn(rows, k)
    x[:, :8] *= 30.0  # a few salient channels, as in real LLM activations
    return x


def test_awq_beats_plain_rtn_on_salient_channels():
    x = _uneven_activations()
    w = torch.randn(128, 256) * 0.05
    stats = ActivationStats(x.abs().mean(0), x)
    q, input_scale, alpha = quantize_awq(w, stats, 128)
    reference = x @ w.t()
    awq_err = ((x * input_scale) @ q.dequantize().t() - reference).pow(2).mean()
    rtn_err = (x @ quantize_rtn(w, 128).dequantize().t() - reference).pow(2).mean()
    assert alpha > 0
    assert awq_err < 0.8 * rtn_err


def test_int4_linear_applies_input_scale():
    x = _uneven_activations(rows=12)
    w = torch.randn(64, 256) * 0.05
    q, input_scale, _ = quantize_awq(w, ActivationStats(x.abs().mean(0), x), 64)
    layer = Int4Linear(quantize_rtn(w, 64), cpu_int4_max_rows=0)
    layer.set_weight(q, input_scale)
    expected = F.linear(x * input_scale, q.dequantize())
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert "input_scale" in layer.state_dict()


def test_collect_activation_stats_hooks_dense_layers():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = DenseLinear(torch.randn(4, 8), None)
            self.lm_head = DenseLinear(torch.randn(3, 4), None)

        def forward(self, x):
            return self.lm_head(self.proj(x))

    model = Tiny()
    x = torch.randn(5, 8)
    stats = collect_activation_stats(model, lambda: model(x))
    assert set(stats) == {"model.proj"}  # the lm_head stays full precision, never calibrated
    assert torch.allclose(stats["model.proj"].mean_abs, x.abs().mean(0))
    assert stats["model.proj"].sample.shape == (5, 8)
    model(x)  # hooks are removed afterwards


def test_int4_factory_awq_calibrates_once_and_caches(tmp_path):
    from nightshift.engine.layers.linear import WeightSource
    from nightshift.engine.quant.cache import QuantizedCheckpointCache, cache_file
    from nightshift.engine.quant.config import QuantConfig
    from nightshift.engine.quant.linear_factory import Int4LinearFactory

    x = _uneven_activations(rows=64, k=128)
    w = torch.randn(32, 128) * 0.05
    name = "model.layers.0.mlp.down_proj"
    source = WeightSource(name=name, parts=["w"], tensor=lambda n: w if n == "w.weight" else None,
                          gguf=lambda n: None, dtype=torch.float32, device=torch.device("cpu"))
    config = QuantConfig(method="awq", group_size=64)
    calls = []

    def calibrate():
        calls.append(1)
        return {name: ActivationStats(x.abs().mean(0), x)}

    path = cache_file(tmp_path, "a" * 64, config)
    cache = QuantizedCheckpointCache(path)
    first = Int4LinearFactory(config, cache, calibrate)(source)
    cache.save_if_changed()
    assert calls == [1] and first.input_scale is not None
    second = Int4LinearFactory(config, QuantizedCheckpointCache(path), calibrate)(source)
    assert calls == [1]  # a cache hit needs no calibration
    assert torch.equal(first.input_scale, second.input_scale)
    assert torch.equal(first(x), second(x))
    rtn = Int4LinearFactory(QuantConfig(group_size=64))(source)
    reference = x @ w.t()
    assert (first(x) - reference).pow(2).mean() < (rtn(x) - reference).pow(2).mean()
    import pytest
    with pytest.raises(ValueError, match="needs calibration activations"):
        Int4LinearFactory(config)(source)  # no loader, no calibration

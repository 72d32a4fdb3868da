"""oneDNN's packed float32 linear on CPU (engine/layers/cpu_gemm.py) and DenseLinear on top of it."""
import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.layers import cpu_gemm
from nightshift.engine.layers.linear import DenseLinear

needs_onednn = pytest.mark.skipif(not cpu_gemm.available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    packed = cpu_gemm.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    assert torch.equal(packed.to_dense(), weight)   # a layout change only
    x = torch.randn(rows, 96)
    torch.testing.assert_close(cpu_gemm.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 96)[:, :, :]          # leading dims pass through
    assert cpu_gemm.linear(x3, packed).shape == (2, rows, 200)


def test_only_float32_cpu_weights_are_packed():
    assert cpu_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.pack(torch.randn(8)) is None
    assert not cpu_gemm.applies(torch.randn(8, 8, dtype=torch.bfloat16))
    assert cpu_gemm.applies(torch.randn(8, 8)) == cpu_gemm.available()


def test_dense_linear_unpacks_its_weight_and_can_be_turned_off(monkeypatch):
    weight, bias = torch.randn(48, 32), torch.randn(48)
    x = torch.randn(5, 32)
    layer = DenseLinear(weight.clone(), bias)
    assert (layer.packed is not None) == cpu_gemm.available()
    assert torch.equal(layer.weight, weight) and (layer.in_features, layer.out_features) == (32, 48)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("NIGHTSHIFT_CPU_GEMM", "0")
    cpu_gemm.available.cache_clear()
    try:
        plain = DenseLinear(weight.clone(), bias)
        assert plain.packed is None and torch.equal(plain(x), F.linear(x, weight, bias))
    finally:
        monkeypatch.undo()
        cpu_gemm.available.cache_clear()

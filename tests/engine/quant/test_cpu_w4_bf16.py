"""Our INT4 x bfloat16 kernel of small CPU steps (engine/quant/cpu_w4_bf16.py): the exact 4-bit
weights against the bfloat16 rows, float32 sums, one bfloat16 rounding at the end; each row's
result its own; closer to the exact product than torch's int4 kernel it replaces."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.quant import cpu_w4_bf16
from nightshift.engine.quant.cpu_kernels import pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from nightshift.engine.quant.format import Int4Weight
from nightshift.engine.quant.int4_linear import Int4Linear

pytestmark = pytest.mark.skipif(not cpu_w4_bf16.available(), reason="needs AVX-512 BF16 and a C compiler")


def _weight(n: int, k: int, group: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half()
    mins = (-torch.rand(n, k // group, generator=g) * 0.15).half()
    return Int4Weight(q, scales, mins, group)


@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (96, 192, 64), (33, 256, 128), (576, 1536, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_rows_match_the_exact_product_each_row_alone(n, k, group, rows):
    weight = _weight(n, k, group)
    packed = cpu_w4_bf16.W4Bf16Weight(weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = packed.linear(x)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    exact = x.double() @ weight.dequantize(torch.float64).T
    # one bfloat16 rounding of a float32 sum: within one bfloat16 step of the exact value
    step = exact.abs().clamp_min(exact.abs().max() * 1e-3) * 2.0 ** -7
    assert ((y.double() - exact).abs() <= step).all()
    for i in range(rows):           # a row's bits do not depend on the rows beside it
        assert torch.equal(packed.linear(x[i:i + 1]), y[i:i + 1])


def test_closer_to_the_exact_product_than_torchs_int4_kernel():
    weight = _weight(960, 576, 32, seed=3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    exact = x.double() @ weight.dequantize(torch.float64).T
    ours = cpu_w4_bf16.W4Bf16Weight(weight).linear(x).double()
    torchs = tinygemm_linear(x, pack_for_tinygemm(weight), 32, tinygemm_scales_and_zeros(weight, torch.bfloat16))
    assert (ours - exact).abs().max() <= (torchs.double() - exact).abs().max()


def test_an_int4_layers_small_steps_run_it():
    weight = _weight(64, 128, 32, seed=5)
    layer = Int4Linear(weight, torch.randn(64), cpu_int4_max_rows=8)
    x = torch.randn(2, 128)
    assert layer.kernel_for(x) == "w4-bf16"
    expected = cpu_w4_bf16.W4Bf16Weight(weight).linear(x.bfloat16()).float() + layer.bias
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.linear_bf16(x.bfloat16()), cpu_w4_bf16.W4Bf16Weight(weight).linear(x.bfloat16()))

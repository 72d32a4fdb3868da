"""The W8A8 CPU kernel (engine/quant/cpu_w8a8.py): Q8_0 weights against int8 activations. Its result
equals, to float32 rounding, the product of the Q8_0 weight with the activations quantized as the
W4A8 kernel quantizes them (int8 per row and block of 32, the block's absolute maximum to 127), on
shapes that need row and output padding, float32 and bfloat16 in; weights at both ends of int8
(the unsigned-activation offset must cancel exactly); a row's result does not depend on the other
rows of the call; the AVX-512 VNNI form (built where the CPU has it) gives the AVX2 form's bits."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.quant import cpu_w8a8

pytestmark = pytest.mark.skipif(not cpu_w8a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


def q8_0(out_features: int, in_features: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 values (every int8 but -128, as GGUF's rounding gives) and positive scales."""
    values = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 1e-2 + 1e-4
    return values, scales


def reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 model of the kernel's arithmetic."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 127
    xq = torch.where(amax > 0, torch.round(blocks / torch.where(amax > 0, scale, 1)), 0).clamp(-127, 127)
    weight = values.double() * scales.double().repeat_interleave(32, 1)
    return (xq * scale).reshape(m, k) @ weight.T


@pytest.mark.parametrize("out_features,in_features,rows", [
    (40, 64, 5),            # outputs padded 40 -> 64, rows 5 -> 8
    (576, 576, 13),
    (100, 256, 1),
    (17, 32, 3),
    (1000, 96, 64),
])
def test_matches_the_quantized_product(out_features, in_features, rows):
    generator = torch.Generator().manual_seed(out_features + rows)
    values, scales = q8_0(out_features, in_features, generator)
    values[0] = 127                                          # the ends of int8: the offset's sums at their largest
    values[-1] = -127
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :32] = 0                                            # an all-zero block
    weight = cpu_w8a8.W8A8Weight(values, scales)
    expected = reference(x, values, scales)
    got = weight.linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert float((got.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    # bfloat16 in: the same values (x rounded to bfloat16 first)
    xb = x.bfloat16()
    assert torch.equal(weight.linear(xb), weight.linear(xb.float()))
    # the AVX2 form (built without AVX-512 whatever the CPU): the same integers and float operations
    # in the same order as the VNNI one, so the same bits
    assert torch.equal(weight.linear(x, avx2=True), got)
    assert torch.equal(weight.linear(xb, avx2=True), weight.linear(xb))


def test_close_to_the_float_product():
    """Against the unquantized activations the error is int8 rounding's: well under 1% of the
    largest output on Gaussian rows."""
    generator = torch.Generator().manual_seed(3)
    values, scales = q8_0(512, 576, generator)
    x = torch.randn(16, 576, generator=generator)
    exact = x.double() @ (values.double() * scales.double().repeat_interleave(32, 1)).T
    got = cpu_w8a8.W8A8Weight(values, scales).linear(x).double()
    assert float((got - exact).abs().max()) <= 1e-2 * float(exact.abs().max())


def test_a_row_does_not_depend_on_the_rest_of_the_call():
    generator = torch.Generator().manual_seed(1)
    weight = cpu_w8a8.W8A8Weight(*q8_0(96, 128, generator))
    x = torch.randn(37, 128, generator=generator)
    whole = weight.linear(x)
    for start, stop in ((0, 1), (5, 9), (30, 37)):
        assert torch.equal(weight.linear(x[start:stop]), whole[start:stop])


def test_rejects_what_is_not_q8_0():
    values, scales = q8_0(16, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="int8 values"):
        cpu_w8a8.W8A8Weight(values.to(torch.int16), scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_w8a8.W8A8Weight(values[:, :40], scales[:, :1])
    with pytest.raises(ValueError, match="scales"):
        cpu_w8a8.W8A8Weight(values, scales[:, :1])

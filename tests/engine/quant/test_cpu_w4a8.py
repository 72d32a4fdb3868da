"""The W4A8 CPU kernel (engine/quant/cpu_w4a8.py): its result equals, to float32 rounding, the
product of the INT4 weight with the activations quantized as the kernel documents (int8 per row
and block of 32, the block's absolute maximum to 127; the mins against exact float sums), on
shapes that need row and output padding, every group size, float32 and bfloat16 in and out, with
and without a bias; a row's result does not depend on the other rows of the call; the AVX-512
VNNI form (built where the CPU has it) gives the AVX2 form's bits."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.quant import cpu_w4a8
from nightshift.engine.quant.format import Int4Weight, quantize_rtn, unpack_int4

pytestmark = pytest.mark.skipif(not cpu_w4a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


def reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """float64 model of the kernel's arithmetic."""
    m, k = x.shape
    g = weight.group_size
    blocks = x.double().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = amax / 127
    xq = torch.where(amax > 0, torch.round(blocks / torch.where(amax > 0, scale, 1)), 0).clamp(-127, 127)
    q = unpack_int4(weight.qweight).double()
    scales = weight.scales.double().repeat_interleave(g, 1)
    mins = weight.mins.double().repeat_interleave(g, 1)
    return (xq * scale).reshape(m, k) @ (q * scales).T + x.double() @ mins.T


@pytest.mark.parametrize("out_features,in_features,group,rows", [
    (40, 64, 32, 5),        # outputs padded 40 -> 48, rows 5 -> 8
    (576, 576, 32, 13),
    (100, 256, 64, 1),
    (192, 512, 128, 64),
    (17, 32, 32, 3),
])
def test_matches_the_quantized_product(out_features, in_features, group, rows):
    generator = torch.Generator().manual_seed(out_features + rows)
    weight = quantize_rtn(torch.randn(out_features, in_features, generator=generator), group, clip_search=False)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[0, :32] = 0                                             # an all-zero block
    bias = torch.randn(out_features, generator=generator)
    packed = cpu_w4a8.W4A8Weight(weight)
    expected = reference(x, weight)
    got = packed.linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    tol = 1e-5 * float(expected.abs().max())
    assert float((got.double() - expected).abs().max()) <= tol
    with_bias = packed.linear(x, bias)
    assert float((with_bias.double() - (expected + bias.double())).abs().max()) <= tol
    # bfloat16 in: the same values (x rounded to bfloat16 first); bfloat16 out: the float32 result rounded
    xb = x.bfloat16()
    got_b = packed.linear(xb)
    assert got_b.dtype == torch.bfloat16
    assert torch.equal(got_b, packed.linear(xb.float()).bfloat16())
    # the AVX2 form (built without AVX-512 whatever the CPU): the same integer dots and float
    # operations in the same order as the VNNI one, so the same bits
    assert torch.equal(packed.linear(x, bias, avx2=True), with_bias)
    assert torch.equal(packed.linear(xb, avx2=True), got_b)


def test_bfloat16_out_rounds_as_torch_does_with_infinities_and_nans():
    """Outputs are rounded to bfloat16 eight at a time (the tail one by one): the same bits as
    torch's rounding of the float32 result, wherever that is a number (a NaN stays a NaN: an
    infinite input against mixed-sign weights), in both forms."""
    generator = torch.Generator().manual_seed(7)
    packed = cpu_w4a8.W4A8Weight(quantize_rtn(torch.randn(44, 64, generator=generator), 32, clip_search=False))
    x = torch.randn(6, 64, generator=generator) * 1e3
    x[1, 3] = float("inf")
    x[2] = 0.0
    for form in (False, True):
        float_out = packed.linear(x.bfloat16().float(), avx2=form)
        assert float_out[1].isnan().any() and (float_out[2] == 0).all()
        got, expected = packed.linear(x.bfloat16(), avx2=form), float_out.bfloat16()
        assert torch.equal(got.isnan(), expected.isnan())
        numbers = ~expected.isnan()
        assert torch.equal(got[numbers].view(torch.int16), expected[numbers].view(torch.int16))


def test_the_cpus_form_is_vnni_where_it_can_be():
    from nightshift.engine.cpu_features import cpu_flags
    assert cpu_w4a8.uses_vnni() == ({"avx512_vnni", "avx512bw"} <= cpu_flags())
    assert cpu_w4a8.load(avx2=True) is not None


def test_a_row_does_not_depend_on_the_rest_of_the_call():
    generator = torch.Generator().manual_seed(1)
    packed = cpu_w4a8.W4A8Weight(quantize_rtn(torch.randn(96, 128, generator=generator), 32, clip_search=False))
    x = torch.randn(37, 128, generator=generator)
    whole = packed.linear(x)
    for start, stop in ((0, 1), (5, 9), (30, 37)):
        assert torch.equal(packed.linear(x[start:stop]), whole[start:stop])


def test_the_weight_stays_four_bits():
    weight = quantize_rtn(torch.randn(256, 512), 32, clip_search=False)
    packed = cpu_w4a8.W4A8Weight(weight)
    assert packed.packed.dtype == torch.uint8 and packed.packed.numel() == 256 * 512 // 2

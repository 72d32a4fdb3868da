"""Our INT4 format: packing, round-to-nearest quantization and its error bound."""
import pytest
import torch

from nightshift.engine.quant.format import Int4Weight, fitting_group_size, pack_int4, quantize_rtn, unpack_int4


def test_pack_unpack_round_trip_all_values():
    q = torch.arange(16, dtype=torch.uint8).repeat(8, 4)  # [8, 64], every nibble value
    q = q[:, torch.randperm(64, generator=torch.Generator().manual_seed(1))]
    packed = pack_int4(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_pack_layout_even_low_odd_high():
    q = torch.tensor([[3, 12, 0, 15]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[3 | (12 << 4), 0 | (15 << 4)]]


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_error_bound(group_size):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    w[0, :group_size] = 0.3  # a constant group: scale 0, represented exactly by its min
    qw = quantize_rtn(w, group_size, clip_search=False)
    assert qw.qweight.shape == (96, 128)
    assert qw.scales.shape == (96, 256 // group_size)
    deq = qw.dequantize()
    assert torch.allclose(deq[0, :group_size], torch.full((group_size,), 0.3), atol=1e-3)
    # error <= half a step, plus float16 rounding of min/scale (relative 2^-11 of each term)
    scale = qw.scales.float().repeat_interleave(group_size, dim=1)
    grid = w.reshape(96, -1, group_size)
    span = (grid.amax(-1) - grid.amin(-1)).repeat_interleave(group_size, dim=1)
    magnitude = grid.abs().amax(-1).repeat_interleave(group_size, dim=1)
    bound = 0.5 * scale + (span + magnitude) * 2 ** -10 + 1e-7
    assert ((deq - w).abs() <= bound).all()
    # and the error is not trivially zero: this is 4-bit
    assert (deq - w).abs().mean() > 1e-4


@pytest.mark.parametrize("group_size", [32, 128])
def test_clip_search_never_worse_per_group(group_size):
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.05
    w[::7, 3] = 1.0  # outliers: clipping them pays off
    def group_sse(qw):
        return (qw.dequantize() - w).pow(2).reshape(64, -1, group_size).sum(-1)
    plain, clipped = group_sse(quantize_rtn(w, group_size, clip_search=False)), group_sse(quantize_rtn(w, group_size))
    assert (clipped <= plain + 1e-9).all()
    assert clipped.sum() < 0.99 * plain.sum()


def test_rtn_smaller_group_is_more_accurate():
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    errors = [(quantize_rtn(w, g).dequantize() - w).pow(2).mean().item() for g in (32, 64, 128)]
    assert errors[0] < errors[1] < errors[2]


def test_rtn_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_rtn(torch.randn(4, 96), 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_rtn(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(torch.randn(4), 32)


def test_int4weight_validates_and_reshapes():
    qw = quantize_rtn(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="scales has shape"):
        Int4Weight(qw.qweight, qw.scales[:, :1], qw.mins, 32)
    rows = torch.tensor([3, 0, 7])
    assert torch.equal(qw.select_rows(rows).dequantize(), qw.dequantize()[rows])
    fused = Int4Weight.cat_rows([qw, qw.select_rows(rows)])
    assert torch.equal(fused.dequantize(), torch.cat([qw.dequantize(), qw.dequantize()[rows]]))
    with pytest.raises(ValueError, match="different group sizes"):
        Int4Weight.cat_rows([qw, quantize_rtn(torch.randn(8, 64), 64)])
    assert qw.nbytes() == 8 * 32 + 2 * 8 * 2 * 2


def test_fitting_group_size():
    assert fitting_group_size(1536, 128) == 128
    assert fitting_group_size(576, 128) == 64
    assert fitting_group_size(576, 32) == 32
    with pytest.raises(ValueError, match="not a multiple of any supported group size"):
        fitting_group_size(80, 128)

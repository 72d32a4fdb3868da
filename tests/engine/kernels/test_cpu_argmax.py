"""The CPU row-argmax kernel (engine/kernels/cpu_argmax.py) gives torch's argmax, ties and NaN included."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.kernels import cpu_argmax


@pytest.fixture(autouse=True)
def _kernel():
    if cpu_argmax.load() is None:
        pytest.skip("no C compiler here: the sampler uses torch's argmax")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (256, 49152), (5, 1000)])
def test_matches_torch_argmax(rows, vocab, dtype):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(cpu_argmax.row_argmax(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_infinities_and_nan_as_torch(dtype):
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    x[0, 5] = x[0, 250] = 100.0                       # a tie: the first index
    x[1, 17] = float("nan"); x[1, 3] = float("nan")  # NaN wins, the first NaN
    x[2] = float("-inf")                              # all -inf: index 0
    x[3, 299] = float("inf")                          # +inf at the last index
    x[4, :] = 1.0                                     # all equal: index 0
    x[5, 0] = float("nan")
    x = x.to(dtype)                                   # bfloat16: more ties, the same first index
    expected = x.float().argmax(dim=-1)
    assert expected.tolist()[:5] == [5, 3, 0, 299, 0]
    assert torch.equal(cpu_argmax.row_argmax(x), expected)


def test_other_tensors_take_torchs_argmax():
    x = torch.randn(4, 64)
    for other in (x.half(), x.t(), x[0]):
        assert torch.equal(cpu_argmax.row_argmax(other), other.argmax(dim=-1))
    assert cpu_argmax.row_argmax(torch.empty(0, 10)).shape == (0,)

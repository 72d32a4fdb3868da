"""The C bitmask kernel against the torch unpacking it replaces: the same logits, the same rows
found empty, for a vocabulary that is not a multiple of 32 and mask rows applied to other rows."""
import pytest
import torch

from nightshift.engine.grammar import allowed_tokens
from nightshift.engine.kernels import cpu_token_bitmask

pytestmark = pytest.mark.skipif(cpu_token_bitmask.load() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_kernel_equals_torch_unpacking(vocab):
    words = (vocab + 31) // 32
    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (9, words), dtype=torch.int32, generator=g)
    bitmask[0] = -1                   # everything allowed
    bitmask[1] = 0                    # nothing allowed
    bitmask[2, :] = 0
    bitmask[2, -1] = -2**31           # only the bit past the vocabulary's end (ignored) when vocab % 32
    logits = torch.randn(12, vocab, generator=g)
    rows = torch.tensor([11, 0, 3, 4, 5, 6, 7, 8, 9])
    expected = logits.clone()
    allowed = allowed_tokens(bitmask, vocab)
    expected[rows] = expected[rows].masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    allowed_any = cpu_token_bitmask.apply_token_bitmask(out, rows, bitmask)
    assert torch.equal(out, expected)
    assert allowed_any.tolist() == allowed.any(dim=1).tolist()
    assert allowed_any[0] and not allowed_any[1]

"""The Q8_0 LM head of one-row steps (engine/layers/q8_head.py): the GGUF's own int8 values and
scales, exactly the float weights the model holds; its logits equal the float32 head's to float32
summation order, and the default model's batch-1 steps use it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.layers import q8_head
from nightshift.engine.layers.linear import GGUFBlocks
from nightshift.engine.loader import load_checkpoint

pytestmark = pytest.mark.skipif(q8_head.load() is None, reason="needs an AVX-512 CPU and a C compiler")


def test_synthetic_q8_0_rows_match_their_dequantized_product():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=g)                 # 40 rows: the last group of 16 padded
    raw = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    head = q8_head.Q8Head(GGUFBlocks(raw, int(GGMLQuantizationType.Q8_0), 40, 96))
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    assert torch.equal(head.dequantize(), exact)
    x = torch.randn(1, 96, generator=g)
    torch.testing.assert_close(head.linear(x), F.linear(x, exact), rtol=1e-5, atol=1e-5)
    assert torch.equal(head.linear(x.bfloat16()), head.linear(x.bfloat16().float()))
    with pytest.raises(AssertionError, match="one row"):
        head.linear(torch.randn(2, 96))


def test_the_default_models_head_is_its_gguf_q8_0_embedding(fp32_model):
    checkpoint = load_checkpoint("default")
    head = fp32_model.q8_head
    assert head is not None and torch.equal(head.dequantize(), fp32_model.embed_tokens)
    assert checkpoint.gguf("model.embed_tokens.weight").qtype == q8_head.Q8_0
    hidden = torch.randn(1, fp32_model.config.hidden_size)
    expected = F.linear(hidden, fp32_model.embed_tokens)
    got = fp32_model.project_logits(hidden)
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert fp32_model.project_logits(torch.randn(3, fp32_model.config.hidden_size)).shape[0] == 3   # dense head

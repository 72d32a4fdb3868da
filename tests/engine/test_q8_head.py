"""The Q8_0 LM head of an INT4 model (engine/layers/q8_head.py): the GGUF's own int8 values and
scales, exactly the float weights the model holds. Its small steps' logits equal the float32 head's
to float32 summation order, each row computed alone; only the steps that run the INT4 layers on our
small-step kernels use it; a model on the W4A8 kernel sends every call to it, on int8 activations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.layers import q8_head
from nightshift.engine.layers.linear import GGUFBlocks
from nightshift.engine.loader import load_checkpoint, load_model
from nightshift.engine.quant import cpu_w8a8
from nightshift.engine.quant.config import QuantConfig

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
    x = torch.randn(5, 96, generator=g)
    y = head.linear(x)
    torch.testing.assert_close(y, F.linear(x, exact), rtol=1e-5, atol=1e-5)
    for i in range(5):                                        # each row alone gives the same bits
        assert torch.equal(head.linear(x[i:i + 1]), y[i:i + 1])
    assert torch.equal(head.linear(x.bfloat16()), head.linear(x.bfloat16().float()))
    with pytest.raises(AssertionError, match="rows of 96"):
        head.linear(torch.randn(2, 95))


@pytest.mark.slow
def test_an_int4_models_small_steps_read_the_gguf_q8_0_head(fp32_model, monkeypatch):
    assert fp32_model.q8_head is None                         # full precision: one head for every step
    int4 = load_model("default", dtype=torch.float32, quant_config=QuantConfig(), cpu_math="float32",
                      cpu_int4="dense")
    head = int4.q8_head
    assert head is not None and int4.q8_head_rows == QuantConfig().cpu_int4_max_rows
    assert load_checkpoint("default").gguf("model.embed_tokens.weight").qtype == q8_head.Q8_0
    assert torch.equal(head.dequantize(), fp32_model.embed_tokens)
    hidden = torch.randn(int4.q8_head_rows + 1, fp32_model.config.hidden_size)
    expected = F.linear(hidden, fp32_model.embed_tokens)
    calls = []
    monkeypatch.setattr(head, "linear", lambda x, real=head.linear: calls.append(x.shape[0]) or real(x))
    small = int4.project_logits(hidden[:-1])                 # cpu_int4_max_rows rows: the Q8_0 head
    assert (small - expected[:-1]).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert int4.project_logits(hidden).shape[0] == hidden.shape[0] and calls == [hidden.shape[0] - 1]
    assert not int4.q8_head_int8


@pytest.mark.slow
@pytest.mark.skipif(not cpu_w8a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")
def test_a_w4a8_models_every_head_call_is_q8_0_against_int8_activations(fp32_model, monkeypatch):
    """The W4A8 layers quantize every step's activations to int8: the head follows on every call,
    small and large, through the W8A8 kernel on the GGUF's Q8_0 blocks (engine/quant/cpu_w8a8.py),
    its logits those of the exact Q8_0 weights up to int8 activation rounding."""
    w4a8 = load_model("default", dtype=torch.float32, quant_config=QuantConfig(), cpu_math="float32",
                      cpu_int4="w4a8")
    head = w4a8.q8_head
    assert head is not None and w4a8.q8_head_int8
    assert w4a8.lm_head is None                  # no packed dense head kept beside it (tied: the embedding remains)
    calls = []
    monkeypatch.setattr(head, "linear_int8", lambda x, real=head.linear_int8: calls.append(x.shape[0]) or real(x))
    monkeypatch.setattr(head, "linear", lambda x: pytest.fail("the float-activation head ran"))
    hidden = torch.randn(300, fp32_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = F.linear(hidden, fp32_model.embed_tokens)
    for rows in (1, 300):                    # a batch-1 step's row and more rows than any small step
        got = w4a8.project_logits(hidden[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, fp32_model.config.vocab_size)
        assert (got - expected[:rows]).abs().max().item() <= 1e-2 * expected[:rows].abs().max().item()
        assert torch.equal(got, head.linear_int8(hidden[:rows]))
    assert calls == [1, 1, 300, 300]


@pytest.mark.skipif(not cpu_w8a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")
def test_a_full_precision_model_on_bf16_with_the_q8_head_sends_every_call_to_it(fp32_model, monkeypatch):
    """The bf16 CPU math's model with its LM head on the GGUF's Q8_0 blocks (cpu_math.choose_head,
    here forced): every call, small and large, through the W8A8 kernel on int8 activations, each
    row computed alone (a row's logits the same in any step), close to the exact head's."""
    from nightshift.engine.layers import cpu_math
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here")
    monkeypatch.setenv(cpu_math.HEAD_ENV, "q8")
    model = load_model("default", dtype=torch.float32, cpu_math="bf16")
    head = model.q8_head
    assert head is not None and model.q8_head_int8 and model.cpu_head == cpu_math.Choice("q8", "forced")
    assert model.lm_head is None                 # no packed bf16 head kept beside it
    calls = []
    monkeypatch.setattr(head, "linear_int8", lambda x, real=head.linear_int8: calls.append(x.shape[0]) or real(x))
    monkeypatch.setattr(head, "linear", lambda x: pytest.fail("the float-activation head ran"))
    hidden = torch.randn(300, fp32_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = F.linear(hidden, fp32_model.embed_tokens)
    full = model.project_logits(hidden, float_logits=False)
    assert full.dtype == torch.float32 and (full - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20), slice(0, 256)):
        assert torch.equal(model.project_logits(hidden[rows]), full[rows])
    assert calls == [300, 1, 1, 17, 256]
    dense = load_model("default", dtype=torch.float32, cpu_math="bf16", cpu_head="dense")    # the argument wins
    assert dense.q8_head is None and dense.cpu_head == cpu_math.Choice("dense", "forced")

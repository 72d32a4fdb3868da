"""Phi-3 / Phi-4-mini from a GGUF file (llama.cpp's "phi3"): a tiny random Phi3ForCausalLM written
as llama.cpp's converter writes it (gguf_export.py: the fused attn_qkv and ffn_up (gate|up) tensors
as the checkpoint has them, partial rotary as rope.dimension_count, LongRoPE's factors as the
rope_factors_short / rope_factors_long tensors beside rope.scaling.original_context_length and
rope.scaling.attn_factor; tied embeddings: no output.weight) loads through our GGUF path and matches
transformers float32 (prompts within the original length, where both use the short factors; the
long ones are checked as loaded into the config, test_phi3.py runs them); a Q4_0 projection file
loads its dequantized weights and INT4 imports it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gguf_export import describe_common, ours_logits, reference_logits, write_gguf
from model_check import VOCAB, prompt, randomize_norms
from nightshift.engine.loader import load_model

pytestmark = pytest.mark.slow

ORIGINAL = 64          # original_max_position_embeddings
ROTARY_HALF = 8        # head_dim 32 * partial_rotary_factor 0.5 / 2
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
         "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def reference():
    from transformers import Phi3Config, Phi3ForCausalLM
    g = torch.Generator().manual_seed(7)
    short = (1 + torch.rand(ROTARY_HALF, generator=g)).tolist()
    long = (1 + 8 * torch.rand(ROTARY_HALF, generator=g)).tolist()
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * ORIGINAL,
                        original_max_position_embeddings=ORIGINAL, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "short_factor": short, "long_factor": long,
                                         "original_max_position_embeddings": ORIGINAL},
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Phi3ForCausalLM(config).eval()
    randomize_norms(model)
    return model


def describe_phi3(writer, config) -> None:
    """As convert_hf_to_gguf.py's Phi3MiniModel: rope.dimension_count = rotary_pct * hidden // heads,
    the attention factor sqrt(1 + ln(scale) / ln(original)) of scale = max positions / original."""
    describe_common(writer, config)
    rope = config.rope_parameters
    rotary = int(rope["partial_rotary_factor"] * config.hidden_size) // config.num_attention_heads
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
    scale = config.max_position_embeddings / ORIGINAL
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))


def write(reference, path, quantize=False):
    rope = reference.config.rope_parameters
    factors = {"rope_factors_long.weight": torch.tensor(rope["long_factor"]),
               "rope_factors_short.weight": torch.tensor(rope["short_factor"])}
    write_gguf(reference, path, "phi3", LAYER, describe_phi3, quantize=quantize, extra=factors)


def test_phi3_gguf_f32_matches_transformers(reference, tmp_path):
    path = tmp_path / "phi3-f32.gguf"
    write(reference, path)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    cfg = ours.config
    rope = reference.config.rope_parameters
    assert cfg.architecture == "phi3" and cfg.head_dim == 32 and cfg.rotary_dim == 16 and cfg.tie_word_embeddings
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert cfg.rope_scaling["short_factor"] == pytest.approx(rope["short_factor"])
    assert cfg.rope_scaling["long_factor"] == pytest.approx(rope["long_factor"])
    assert cfg.sliding_window is None
    ids = prompt(40, 3)
    assert (ours_logits(ours, ids) - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_phi3_gguf_q4_0_loads_dequantized_and_imports_blocks_for_int4(reference, tmp_path):
    import gguf
    from nightshift.engine.quant.config import resolve_quant_config
    from nightshift.engine.quant.int4_linear import Int4Linear
    path = tmp_path / "phi3-q4_0.gguf"
    write(reference, path, quantize=True)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    up = reference.model.layers[1].mlp.gate_up_proj.weight.detach().numpy()
    blocks = gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)))
    assert torch.equal(ours.layers[1].mlp.gate_up_proj.weight.float(), expected.reshape(up.shape))
    ids = prompt(24, 4)
    assert torch.isfinite(ours_logits(ours, ids)).all()
    int4 = load_model(str(path), quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path / "cache"),
                      cpu_math="float32")
    assert isinstance(int4.layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(int4.layers[0].mlp.gate_up_proj, Int4Linear)
    assert torch.isfinite(ours_logits(int4, ids)).all()

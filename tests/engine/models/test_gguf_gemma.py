"""Gemma 2 and Gemma 3 text from GGUF files (llama.cpp's "gemma2" / "gemma3"): tiny random
Gemma2ForCausalLM / Gemma3ForCausalLM written as llama.cpp's converter writes them (gguf_export.py:
RMSNorm weights stored as 1 + w, the sandwich norms as post_attention_norm / ffn_norm /
post_ffw_norm, soft-caps and the window in metadata, Gemma 3's q/k norms as attn_q_norm /
attn_k_norm, its global RoPE base and linear scaling in rope.* keys; no output.weight: tied) load
through our GGUF path and match transformers float32 (prompts longer than the window); a Q4_0
projection file loads its dequantized weights and INT4 imports it. Not in the file, implied by the
architecture as llama.cpp implies them: the embedding scale sqrt(hidden), GeGLU, the query scale
1 / sqrt(head_dim) (the tiny configs' query_pre_attn_scalar), Gemma 2's even sliding layers, Gemma 3's
every-sixth global layer and its local RoPE base 10000."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_export import describe_common, ours_logits, reference_logits, write_gguf
from model_check import VOCAB, prompt, randomize_norms
from nightshift.engine.loader import load_model

pytestmark = pytest.mark.slow

WINDOW = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=32,
              rms_norm_eps=1e-6, attn_implementation="eager")
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**COMMON, num_hidden_layers=2, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=3.0)).eval()
    randomize_norms(model)
    return model


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    # six layers: llama.cpp's gemma3 makes every sixth layer global (no layer_types in the file)
    config = Gemma3TextConfig(**COMMON, num_hidden_layers=6,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    model = Gemma3ForCausalLM(config).eval()
    randomize_norms(model)
    return model


def describe_gemma2(writer, config) -> None:
    describe_common(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def describe_gemma3(writer, config) -> None:
    describe_common(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    full = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    writer.add_sliding_window(config.sliding_window)


CASES = {"gemma2": (gemma2, describe_gemma2), "gemma3": (gemma3, describe_gemma3)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    build, describe = CASES[request.param]
    return request.param, build(), describe


def test_gemma_gguf_f32_matches_transformers(case, tmp_path):
    arch, reference, describe = case
    path = tmp_path / f"{arch}-f32.gguf"
    write_gguf(reference, path, arch, LAYER, describe, norm_shift=1.0)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    cfg = ours.config
    assert cfg.tie_word_embeddings and cfg.sliding_window == WINDOW and cfg.query_pre_attn_scalar == 32
    if arch == "gemma2":
        assert cfg.architecture == "gemma2" and cfg.attn_logit_softcapping == 2.0 and cfg.final_logit_softcapping == 3.0
        assert cfg.layer_types == ["sliding_attention", "full_attention"] and not cfg.qk_norm
    else:
        assert cfg.architecture == "gemma3_text" and cfg.qk_norm and cfg.rope_local_base_freq == 10000.0
        assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
        assert cfg.layer_types == reference.config.layer_types
        assert "full_attention" in cfg.layer_types and cfg.attn_logit_softcapping is None
    # the norms hold w (the file's 1 + w less 1), as the HF checkpoint does
    hf_norm = reference.model.layers[1].post_feedforward_layernorm.weight
    assert torch.allclose(ours.layers[1].post_feedforward_layernorm.weight, hf_norm, atol=1e-6)
    ids = prompt(40, 3)
    assert (ours_logits(ours, ids) - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_gemma_gguf_q4_0_loads_dequantized_and_imports_blocks_for_int4(case, tmp_path):
    from nightshift.engine.quant.config import resolve_quant_config
    from nightshift.engine.quant.int4_linear import Int4Linear
    arch, reference, describe = case
    path = tmp_path / f"{arch}-q4_0.gguf"
    write_gguf(reference, path, arch, LAYER, describe, quantize=True, norm_shift=1.0)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    q = reference.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    blocks = gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)))
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight[:q.shape[0]].float(), expected.reshape(q.shape))
    ids = prompt(24, 4)
    assert torch.isfinite(ours_logits(ours, ids)).all()
    int4 = load_model(str(path), quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path / "cache"),
                      cpu_math="float32")
    assert isinstance(int4.layers[0].self_attn.qkv_proj, Int4Linear)
    assert torch.isfinite(ours_logits(int4, ids)).all()

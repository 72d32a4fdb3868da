"""Phi-3 / Phi-4-mini against transformers' Phi3ForCausalLM float32 (checks: model_check.py):
fused qkv_proj / gate_up_proj in the checkpoint, partial rotary, LongRoPE (short factors up to
original_max_position_embeddings, long ones from there on: every decode below crosses it) and
the sliding window."""
from __future__ import annotations

import pytest
import torch

from model_check import VOCAB, check_engine, check_int4, check_steps, engine_prompts, prompt, randomize_norms, save
from nightshift.engine.loader import load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import Phi3ForCausalLM

pytestmark = pytest.mark.slow

ORIGINAL = 64          # original_max_position_embeddings: prompts fit it, their decodes cross it
ROTARY_HALF = 8        # head_dim 32 * partial_rotary_factor 0.5 / 2


def phi3(window=None):
    from transformers import Phi3Config, Phi3ForCausalLM as HFPhi3
    g = torch.Generator().manual_seed(7)
    short = (1 + torch.rand(ROTARY_HALF, generator=g)).tolist()
    long = (1 + 8 * torch.rand(ROTARY_HALF, generator=g)).tolist()
    config = Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * ORIGINAL,
                        original_max_position_embeddings=ORIGINAL, sliding_window=window, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "short_factor": short, "long_factor": long,
                                         "original_max_position_embeddings": ORIGINAL},
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return HFPhi3(config)


@pytest.fixture(scope="module", params=[None, 20], ids=["full", "window20"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = phi3(request.param).eval()
    randomize_norms(reference)
    folder = save(reference, tmp_path_factory.mktemp("phi3"))
    return reference, folder, load_model(folder, cpu_math="float32")


def test_config_and_class(tiny):
    reference, folder, ours = tiny
    assert isinstance(ours, Phi3ForCausalLM)
    cfg = ours.config
    assert cfg.architecture == "phi3" and cfg.rotary_dim == 16 and cfg.rope_scaling["rope_type"] == "longrope"
    assert ours.rotary["global"].cos.shape == (4 * ORIGINAL, 16)
    assert cfg.layer_window(0) == reference.config.sliding_window
    # the fused checkpoint tensors are loaded as they are
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight, reference.model.layers[1].self_attn.qkv_proj.weight)
    assert torch.equal(ours.layers[1].mlp.gate_up_proj.weight, reference.model.layers[1].mlp.gate_up_proj.weight)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_prefill_and_decode_logits_match_hf(tiny, cpu_kernel):
    reference, _, ours = tiny
    check_steps(ours, reference, prompt(45, 1), chunk=16, cpu_kernel=cpu_kernel)   # decode crosses 64


def test_engine_batch_prefix_cache_chunked_matches_hf(tiny):
    reference, _, ours = tiny
    check_engine(ours, reference, prompts=engine_prompts(16, (3, 9, 17, 26, 35, 44, 48, 5)))


def test_int4_load_runs(tiny, tmp_path):
    _, folder, _ = tiny
    check_int4(folder, tmp_path, prompt(20, 2))


def test_longrope_v4_config_and_refusals():
    base = {"model_type": "phi3", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 192, "vocab_size": 100, "max_position_embeddings": 256,
            "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    cfg = ModelConfig.from_hf_config(base)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 64
    assert cfg.rotary_dim == 16
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config({**base, "hidden_act": "gelu_new"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config({**base, "model_type": "qwen3", "rope_scaling": None})

"""Qwen3 from a GGUF file (llama.cpp's "qwen3" architecture): a tiny random Qwen3ForCausalLM written
with the gguf package's GGUFWriter (llama.cpp's tensor names and keys, the default model's
tokenizer fields; F32 tensors, and Q4_0 projections as llama.cpp quantizes them) loads through our
GGUF path and matches transformers on the same weights (F32: its float32 logits after
two prefill chunks; Q4_0: the dequantized weights in HF row order, and the INT4 load runs).

llama.cpp does not permute Qwen3's q/k rows (only its LlamaModel's), and keeps the per-head
q/k norms as blk.N.attn_q_norm / attn_k_norm."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_export import describe_common, ours_logits, reference_logits, write_gguf
from model_check import VOCAB, prompt, randomize_norms
from nightshift.engine.loader import load_model

pytestmark = pytest.mark.slow

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def describe_qwen3(writer, config) -> None:
    describe_common(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])


def write_qwen3(model, path, quantize: bool) -> None:
    write_gguf(model, path, "qwen3", LAYER, describe_qwen3, quantize=quantize)


@pytest.fixture(scope="module")
def reference():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(config).eval()
    randomize_norms(model)
    return model


def test_qwen3_gguf_f32_matches_transformers(reference, tmp_path):
    path = tmp_path / "qwen3-f32.gguf"
    write_qwen3(reference, path, quantize=False)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    cfg = ours.config
    assert cfg.architecture == "qwen3" and cfg.qk_norm and cfg.head_dim == 32 and not cfg.tie_word_embeddings
    assert ours.layers[0].self_attn.q_norm.weight.shape == (32,)
    ids = prompt(40, 3)
    assert (ours_logits(ours, ids) - reference_logits(reference, ids)).abs().max().item() < 1e-4


def test_qwen3_gguf_q4_0_loads_dequantized_and_imports_blocks_for_int4(reference, tmp_path):
    import gguf
    from nightshift.engine.quant.config import resolve_quant_config
    from nightshift.engine.quant.int4_linear import Int4Linear
    path = tmp_path / "qwen3-q4_0.gguf"
    write_qwen3(reference, path, quantize=True)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    # the dense load holds the dequantized Q4_0 weights of each projection, rows in HF order
    q = reference.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    blocks = gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)))
    got = ours.layers[1].self_attn.qkv_proj.weight[:q.shape[0]]
    assert torch.equal(got.float(), expected.reshape(q.shape))
    ids = prompt(24, 4)
    logits = ours_logits(ours, ids)
    assert torch.isfinite(logits).all()
    int4 = load_model(str(path), quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path / "cache"),
                      cpu_math="float32")
    assert isinstance(int4.layers[0].self_attn.qkv_proj, Int4Linear)
    assert torch.isfinite(ours_logits(int4, ids)).all()

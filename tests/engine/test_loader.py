"""Loading: GGUF (converted-weight cache, Q/K permutation, raw blocks) and HF directories
(tiny random Llama / Qwen2 written by transformers itself), checked against transformers."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from nightshift.engine.loader import load_checkpoint, load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.model_files import cache_entry, model_name, resolve_model, source_fingerprint
from nightshift.engine.model_runner import ModelRunner, StepItem

pytestmark = pytest.mark.slow


def test_resolve_model_errors(tmp_path):
    assert resolve_model("default").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_default_config_from_gguf(fp32_model):
    cfg = fp32_model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (576, 30, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert cfg.name == model_name(resolve_model("default")) == "SmolLM2-135M-Instruct"


def test_weights_equal_transformers_gguf_load(fp32_model, hf_reference_model):
    """Same float32 values as transformers' own GGUF loader, Q/K permutation undone the same way."""
    hf = dict(hf_reference_model.named_parameters())
    layer = fp32_model.layers[7]
    q, k, v = layer.self_attn.qkv_proj.weight.split([576, 192, 192])
    prefix = "model.layers.7."
    assert torch.equal(q, hf[prefix + "self_attn.q_proj.weight"])
    assert torch.equal(k, hf[prefix + "self_attn.k_proj.weight"])
    assert torch.equal(v, hf[prefix + "self_attn.v_proj.weight"])
    gate, up = layer.mlp.gate_up_proj.weight.split(1536)
    assert torch.equal(gate, hf[prefix + "mlp.gate_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, hf[prefix + "mlp.down_proj.weight"])
    assert torch.equal(fp32_model.embed_tokens, hf["model.embed_tokens.weight"])
    assert torch.equal(fp32_model.norm.weight, hf["model.norm.weight"])


def test_raw_gguf_blocks_are_in_hf_row_order(default_model_path):
    """The INT4 path gets raw blocks whose rows match the dense (unpermuted) weight."""
    checkpoint = load_checkpoint(default_model_path)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.3.mlp.up_proj.weight"):
        blocks = checkpoint.gguf(name)
        dense = checkpoint.tensor(name)
        assert (blocks.out_features, blocks.in_features) == tuple(dense.shape)
        assert np.array_equal(dequantize(blocks.raw, blocks.qtype), dense.numpy())
    assert checkpoint.gguf("model.layers.3.input_layernorm.weight") is None   # stored as float


def test_conversion_cache_first_and_second_load(default_model_path, tmp_path):
    """First load converts into the cache; the second only maps it (figures printed with -s)."""
    start = time.perf_counter()
    first = load_model(default_model_path, cache_dir=str(tmp_path))
    convert_seconds = time.perf_counter() - start
    entry = cache_entry(default_model_path, str(tmp_path))
    assert (entry / "weights.safetensors").exists() and (entry / "tokenizer.json").exists()
    start = time.perf_counter()
    second = load_model(default_model_path, cache_dir=str(tmp_path))
    cached_seconds = time.perf_counter() - start
    print(f"\nload default model: first (convert) {convert_seconds:.1f} s, cached {cached_seconds:.1f} s")
    assert cached_seconds < convert_seconds
    assert torch.equal(first.layers[0].self_attn.qkv_proj.weight, second.layers[0].self_attn.qkv_proj.weight)
    assert len(list(tmp_path.iterdir())) == 1


def test_fingerprint_follows_file_changes(default_model_path, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(default_model_path, copy)
    before = source_fingerprint(str(copy))
    assert source_fingerprint(str(copy)) == before
    with open(copy, "r+b") as handle:   # rewrite the last byte: size same, content and mtime differ
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 0xFF]))
    assert source_fingerprint(str(copy)) != before


def test_hf_config_parsing():
    base = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "sliding_window": 32, "max_position_embeddings": 128}
    cfg = ModelConfig.from_hf_config(base)
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and not cfg.attention_bias
    assert cfg.max_position_embeddings == 128 and cfg.kv_window == 32, "Mistral's window on every layer, no cap"
    with pytest.raises(ValueError, match="missing intermediate_size"):
        ModelConfig.from_hf_config({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        ModelConfig.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=49152, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def tiny_llama(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**TINY, tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return LlamaForCausalLM(config)


def tiny_qwen2(path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    with torch.no_grad():   # random q/k/v biases (they start at zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def tiny_mistral(path: Path):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=4096,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0}))


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_mistral],
                         ids=["llama-untied-llama3rope", "qwen2-bias-tied", "mistral-linearrope"])
def test_hf_directory_logits_match_transformers(make, hf_tokenizer, tmp_path):
    torch.manual_seed(0)
    reference = make(tmp_path).eval()
    reference.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    ours = load_model(str(tmp_path), cpu_math="float32")    # the path that matches HF float32
    assert ours.config.architecture == saved["model_type"]
    assert ours.config.tie_word_embeddings == saved["tie_word_embeddings"]
    rope = saved.get("rope_parameters") or saved.get("rope_scaling") or {}
    assert (ours.config.rope_scaling or {}).get("rope_type") == \
        (None if rope.get("rope_type", "default") == "default" else rope["rope_type"])

    ids = hf_tokenizer.encode("A tiny model still has to agree with transformers, token for token. " * 2)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    runner = ModelRunner(ours, num_kv_blocks=8, block_size=16)
    table = [5, 2, 7, 0]
    got = {len(ids) - 9: runner.execute([StepItem(ids[:-8], 0, table)])[0]}
    got[len(ids) - 4] = runner.execute([StepItem(ids[-8:-3], len(ids) - 8, table)])[0]
    for pos in range(len(ids) - 3, len(ids)):
        got[pos] = runner.execute([StepItem([ids[pos]], pos, table)])[0]
    worst = max((row - expected[pos]).abs().max().item() for pos, row in got.items())
    assert worst < 1e-4, f"max abs logit difference {worst:.2e}"


def test_gguf_rope_freqs_divisors_reproduce_llama3_scaling():
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors (`rope_freqs.weight`);
    dividing by them must give the same tables as the llama3 rule from a HF config."""
    from nightshift.engine.gguf_file import hf_name
    from nightshift.engine.models.llama import RotaryEmbedding, rope_inv_freq
    base = dict(architecture="llama", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=100, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=512, tie_word_embeddings=True)
    plain = ModelConfig(**base)
    scaled = ModelConfig(**base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    divisors = rope_inv_freq(plain) / rope_inv_freq(scaled)
    assert divisors.max() > 7.9 and divisors.min() == 1.0
    assert torch.allclose(RotaryEmbedding(plain, divisors).cos, RotaryEmbedding(scaled).cos, atol=1e-5)
    assert hf_name("rope_freqs.weight") == "rope_freqs"
    assert hf_name("blk.3.attn_k.weight") == "model.layers.3.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="no known Llama-family mapping"):
        hf_name("blk.0.ffn_gate_exps.weight")      # experts in a dense llama file
    assert hf_name("blk.0.ffn_gate_exps.weight", "mixtral") == "model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
    assert hf_name("blk.2.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.2.mlp.shared_expert_gate.weight"
    # the same llama.cpp name means another HF tensor in Gemma's and Phi-3's layouts
    assert hf_name("blk.1.ffn_norm.weight", "gemma2") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert hf_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"
    with pytest.raises(ValueError, match="no known Llama-family mapping in llama.cpp's 'gemma2' layout"):
        hf_name("blk.0.attn_q_norm.weight", "gemma2")


def test_gguf_metadata_config_errors():
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.attention.head_count": 4, "llama.feed_forward_length": 128, "llama.vocab_size": 100}
    cfg = ModelConfig.from_gguf_metadata(meta, has_output_weight=True)
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 4 and not cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="missing 'llama.block_count'"):
        ModelConfig.from_gguf_metadata({k: v for k, v in meta.items() if k != "llama.block_count"}, True)
    # mixtures of experts llama.cpp writes that the engine does not run: refused by name
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'deepseek2'"):
        ModelConfig.from_gguf_metadata({**meta, "general.architecture": "deepseek2"}, True)
    with pytest.raises(ValueError, match="missing 'qwen3moe.expert_count'"):
        ModelConfig.from_gguf_metadata({k.replace("llama", "qwen3moe"): v for k, v in meta.items()}
                                       | {"general.architecture": "qwen3moe"}, True)
    mixtral = ModelConfig.from_gguf_metadata({**meta, "llama.expert_count": 4, "llama.expert_used_count": 2}, True)
    assert mixtral.architecture == "mixtral" and mixtral.num_experts == 4 and mixtral.norm_topk_prob
    with pytest.raises(ValueError, match="llama.attention.scale"):
        ModelConfig.from_gguf_metadata({**meta, "llama.attention.scale": 0.1}, True)
    with pytest.raises(ValueError, match="llama.rope.dimension_count=8 differs"):   # partial rotary: phi3 only
        ModelConfig.from_gguf_metadata({**meta, "llama.attention.key_length": 16,
                                        "llama.rope.dimension_count": 8}, True)
    linear = ModelConfig.from_gguf_metadata({**meta, "llama.rope.scaling.type": "linear",
                                             "llama.rope.scaling.factor": 4.0}, True)
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 4.0}

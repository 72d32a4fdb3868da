"""Mixtures of experts from GGUF files as llama.cpp's converter writes them: Mixtral (architecture
"llama" with llama.expert_count, q/k rows permuted), Qwen3-MoE ("qwen3moe"), OLMoE ("olmoe",
clamp_kqv) and Qwen2-MoE ("qwen2moe", the shared expert's ffn_*_shexp and ffn_gate_inp_shexp).
A tiny random model of transformers' own class (decisive routing, as test_moe.py) is written by
gguf_export.py (the router as ffn_gate_inp, the experts stacked `[experts, out, in]` in
ffn_{gate,up,down}_exps) and loads through our GGUF path, the stacked experts split into our
per-expert layers: F32 matches transformers float32; Q4_0 stacked experts load dequantized per
expert and INT4 imports them.

llama.cpp puts experts in every layer of these architectures, so the tiny models have no dense
MLP layers (test_moe.py covers mlp_only_layers from HF folders)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_export import describe_common, ours_logits, reference_logits, write_gguf
from model_check import prompt, randomize_norms
from nightshift.engine.loader import load_model
from nightshift.engine.models.moe import SparseMoeBlock
from test_moe import COMMON, decisive_routing

pytestmark = pytest.mark.slow

ATTENTION = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
SHARED = {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}


def hf_model(family: str):
    import transformers as tf
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=8,
                                                      num_experts_per_tok=2))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=128,
                                                        moe_intermediate_size=64, num_experts=6,
                                                        num_experts_per_tok=2, norm_topk_prob=True))
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=96, num_experts=6,
                                                        num_experts_per_tok=2, norm_topk_prob=False))
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(**COMMON, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=False, clip_qkv=1.5, eos_token_id=2, pad_token_id=1))


def describe(family: str):
    """The keys convert_hf_to_gguf.py writes for `family` (experts' widths, shared expert, clamp)."""
    def keys(writer, config) -> None:
        describe_common(writer, config)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_expert_count(config.num_local_experts if family == "mixtral" else config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if family == "qwen3_moe":
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        if family in ("qwen3_moe", "qwen2_moe"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if family == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if family == "olmoe":
            writer.add_clamp_kqv(config.clip_qkv)
    return keys


def write(family, reference, path, quantize=False):
    write_gguf(reference, path, GGUF_ARCH[family], {**ATTENTION, **SHARED}, describe(family), quantize=quantize,
               permute_qk=family == "mixtral")


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def tiny(request):
    torch.manual_seed(0)
    reference = hf_model(request.param).eval()
    randomize_norms(reference)
    decisive_routing(reference)
    return request.param, reference


def test_moe_gguf_f32_matches_transformers(tiny, tmp_path):
    family, reference = tiny
    path = tmp_path / f"{family}-f32.gguf"
    write(family, reference, path)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    cfg, hf = ours.config, reference.config
    assert cfg.architecture == family and cfg.num_experts_per_tok == 2 and cfg.dense_mlp_layers == []
    assert cfg.norm_topk_prob == (family in ("mixtral", "qwen3_moe"))
    moe = ours.layers[1].mlp
    assert isinstance(moe, SparseMoeBlock) and len(moe.experts) == cfg.num_experts
    assert (moe.shared_expert is not None) == (family == "qwen2_moe")
    if family == "olmoe":
        assert cfg.clip_qkv == hf.clip_qkv and not cfg.qk_norm_per_head
    ids = prompt(40, 3)
    got, expected = ours_logits(ours, ids), reference_logits(reference, ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_moe_gguf_q4_0_experts_load_dequantized_and_import_for_int4(tmp_path):
    import gguf
    from nightshift.engine.quant.config import resolve_quant_config
    from nightshift.engine.quant.int4_linear import Int4Linear
    torch.manual_seed(0)
    reference = hf_model("qwen3_moe").eval()
    decisive_routing(reference)
    path = tmp_path / "qwen3moe-q4_0.gguf"
    write("qwen3_moe", reference, path, quantize=True)
    ours = load_model(str(path), cache_dir=str(tmp_path / "cache"), cpu_math="float32")
    # expert 3's down projection: its slice of the stacked Q4_0 tensor, dequantized
    down = reference.model.layers[1].mlp.experts.down_proj[3].detach().numpy()
    blocks = gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q4_0)
    expected = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)).reshape(down.shape)
    assert torch.equal(ours.layers[1].mlp.experts[3].down_proj.weight.float(), torch.from_numpy(expected))
    ids = prompt(24, 4)
    assert torch.isfinite(ours_logits(ours, ids)).all()
    int4 = load_model(str(path), quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path / "cache"),
                      cpu_math="float32")
    assert isinstance(int4.layers[0].mlp.experts[5].gate_up_proj, Int4Linear)
    assert torch.isfinite(ours_logits(int4, ids)).all()


def test_moe_gguf_refusals(tmp_path):
    from nightshift.engine.model_config import ModelConfig
    base = {"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.block_count": 2,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 128, "qwen3moe.vocab_size": 256,
            "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2}
    assert ModelConfig.from_gguf_metadata(base, True).num_experts == 4
    for extra, field in (({"qwen3moe.expert_gating_func": 2}, "expert_gating_func"),
                         ({"qwen3moe.expert_shared_count": 1}, "expert_shared_count"),
                         ({"qwen3moe.expert_group_count": 2}, "expert_group_count")):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_gguf_metadata({**base, **extra}, True)
    with pytest.raises(ValueError, match="expert_count"):
        ModelConfig.from_gguf_metadata({**base, "general.architecture": "qwen3",
                                        **{k.replace("qwen3moe", "qwen3"): v for k, v in base.items()
                                           if k.startswith("qwen3moe.")}}, True)

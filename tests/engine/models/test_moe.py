"""Mixture-of-experts decoders (models/moe.py): Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE against
transformers' MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM and Qwen2MoeForCausalLM
float32 (checks: model_check.py).

The tiny models have their router and expert weights scaled up from transformers' init (std
0.02), so that routing is decisive (the top-k choice and the router weights move the logits
far beyond the tolerance: a wrong normalisation or a wrong expert fails the checks); Qwen2-MoE's
shared expert and its sigmoid gate are scaled up too, and its q/k/v biases made non-zero."""
from __future__ import annotations

import pytest
import torch

from model_check import VOCAB, check_engine, check_int4, check_steps, prompt, randomize_norms, save
from nightshift.engine.loader import load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import MixtralForCausalLM, MoeForCausalLM
from nightshift.engine.models.llama import MLP
from nightshift.engine.models.moe import OlmoeAttention, SparseMoeBlock

pytestmark = pytest.mark.slow

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)


def hf_model(family: str):
    import transformers as tf
    if family == "mixtral":
        config = tf.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        return tf.MixtralForCausalLM(config)
    if family == "qwen2_moe":
        # a shared expert of its own width beside experts of theirs, layer 1 dense (mlp_only_layers),
        # top-k weights not renormalised (its default), q/k/v biases
        config = tf.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                                   norm_topk_prob=False, mlp_only_layers=[1])
        return tf.Qwen2MoeForCausalLM(config)
    if family == "qwen3_moe":
        # layer 1 dense (mlp_only_layers), experts of their own width, renormalised top-k
        config = tf.Qwen3MoeConfig(**COMMON, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                                   num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
        return tf.Qwen3MoeForCausalLM(config)
    # OLMoE: top-k weights not renormalised (its default), q/k norms over the whole projection, clip_qkv
    config = tf.OlmoeConfig(**COMMON, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False, clip_qkv=1.5, eos_token_id=2, pad_token_id=1)
    return tf.OlmoeForCausalLM(config)


def decisive_routing(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight") and param.dim() == 2 and param.shape[0] < 16:
                param.normal_(0.0, 0.3)           # router: clear preferences, far from ties
            elif ".experts." in name or ".shared_expert." in name:
                param.mul_(4.0)
            elif name.endswith("shared_expert_gate.weight"):
                param.normal_(0.0, 0.5)           # the shared expert's sigmoid gate: far from a constant 1/2
            elif name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = hf_model(request.param).eval()
    randomize_norms(reference)
    decisive_routing(reference)
    folder = save(reference, tmp_path_factory.mktemp(request.param))
    return request.param, reference, folder, load_model(folder, cpu_math="float32")


def test_config_and_class(tiny):
    family, _, _, ours = tiny
    cfg = ours.config
    assert cfg.architecture == family and cfg.num_layers == 2 and cfg.num_experts_per_tok == 2
    moe = ours.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock) and len(moe.experts) == cfg.num_experts
    if family == "mixtral":
        assert isinstance(ours, MixtralForCausalLM) and cfg.norm_topk_prob and not cfg.qk_norm
        assert cfg.num_experts == 8 and isinstance(ours.layers[1].mlp, SparseMoeBlock)
    elif family == "qwen2_moe":
        assert type(ours) is MoeForCausalLM and not cfg.qk_norm and not cfg.norm_topk_prob and cfg.attention_bias
        assert cfg.dense_mlp_layers == [1] and type(ours.layers[1].mlp) is MLP and cfg.num_experts == 6
        assert moe.experts[0].intermediate == 32 and moe.shared_expert.intermediate == 96
        assert moe.shared_expert_gate.shape == (1, 64) and ours.layers[0].self_attn.qkv_proj.bias is not None
    elif family == "qwen3_moe":
        assert type(ours) is MoeForCausalLM and cfg.qk_norm and cfg.qk_norm_per_head and cfg.norm_topk_prob
        assert cfg.dense_mlp_layers == [1] and type(ours.layers[1].mlp) is MLP
        assert moe.experts[0].intermediate == 64 and ours.layers[0].self_attn.q_norm.weight.shape == (32,)
    else:
        assert type(ours) is MoeForCausalLM and not cfg.norm_topk_prob and not cfg.qk_norm_per_head
        assert cfg.clip_qkv == 1.5 and isinstance(ours.layers[0].self_attn, OlmoeAttention)
        assert ours.layers[0].self_attn.q_norm.weight.shape == (64,)
        assert ours.layers[0].self_attn.k_norm.weight.shape == (32,)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_prefill_and_decode_logits_match_hf(tiny, cpu_kernel):
    _, reference, _, ours = tiny
    check_steps(ours, reference, prompt(45, 1), chunk=16, cpu_kernel=cpu_kernel)


def test_engine_batch_prefix_cache_chunked_matches_hf(tiny):
    _, reference, _, ours = tiny
    check_engine(ours, reference)


def fused_and_torch_errors(reference, folder: str, length: int):
    """The bf16-math model of `folder` (None where the fused layers cannot run here), and a function
    of its layers (the fused ones, or None: the torch layers) giving the worst logit difference from
    HF float32 over two prefill chunks and decode steps of a `length`-token prompt."""
    from nightshift.engine.kernels import cpu_fused_ops
    from nightshift.engine.layers import cpu_math
    from nightshift.engine.model_runner import ModelRunner
    from nightshift.engine.step import StepItem
    if cpu_fused_ops.load() is None:
        pytest.skip("no C compiler: the torch layers run")
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here (oneDNN refuses bfloat16 weights on an AVX2-only CPU)")
    bf16 = load_model(folder, cpu_math="bf16")
    assert bf16.fused_layers is not None
    ids = prompt(length, 4)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    runner = ModelRunner(bf16, num_kv_blocks=8, block_size=16)
    steps = [(ids[:20], 0), (ids[20:length - 4], 20)] + [([ids[p]], p) for p in range(length - 4, length)]

    def worst(layers) -> float:
        saved, bf16.fused_layers = bf16.fused_layers, layers
        try:
            return max((runner.execute([StepItem(tokens, start, [0, 1, 2])])[0]
                        - expected[start + len(tokens) - 1]).abs().max().item() for tokens, start in steps)
        finally:
            bf16.fused_layers = saved
    return bf16, worst


def test_fused_bf16_layers_follow_hf_as_the_torch_layers_do(tiny):
    """On the bf16 CPU math an MoE layer runs as fused_moe_cpu_layer.FusedMoeCpuLayer (the experts
    grouped, bfloat16 in and out, SiLU-and-mul in C; OLMoE's whole-projection q/k norms and clip in
    rope_store; Qwen2-MoE's q/k/v bias and shared expert) and a dense one (layer 1 of Qwen3-MoE and
    Qwen2-MoE) as FusedCpuLayer: over two prefill chunks and decode steps its logits stay as close
    to HF float32 as the torch layers on the same bf16 math; routing every token to the wrong
    experts would not."""
    from nightshift.engine.models.fused_cpu_layer import FusedCpuLayer
    from nightshift.engine.models.fused_moe_cpu_layer import FusedMoeCpuLayer
    family, reference, folder, _ = tiny
    bf16, worst = fused_and_torch_errors(reference, folder, 40)
    assert [type(f) for f in bf16.fused_layers] == [FusedMoeCpuLayer] + (
        [FusedCpuLayer] if family in ("qwen3_moe", "qwen2_moe") else [FusedMoeCpuLayer])
    assert (bf16.fused_layers[0].clip is not None) == (family == "olmoe")
    fused, torch_layers = worst(bf16.fused_layers), worst(None)
    assert fused <= 1.5 * torch_layers + 1e-3, (fused, torch_layers)
    moe = bf16.fused_layers[0]
    moe.experts = moe.experts[1:] + moe.experts[:1]       # every expert's rows through its neighbour
    assert worst(bf16.fused_layers) > 5 * fused


def test_fused_bf16_layers_keep_mixtrals_window(tmp_path):
    """Mixtral with a sliding window shorter than the prompt: the fused layers hand it to the
    attention kernel (as close to HF float32 as the torch layers; without it, far off)."""
    import transformers as tf
    torch.manual_seed(2)
    config = tf.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=8)
    reference = tf.MixtralForCausalLM(config).eval()
    randomize_norms(reference)
    decisive_routing(reference)
    bf16, worst = fused_and_torch_errors(reference, save(reference, tmp_path / "mixtral-window"), 40)
    assert all(f.window == 8 for f in bf16.fused_layers)
    fused, torch_layers = worst(bf16.fused_layers), worst(None)
    assert fused <= 1.5 * torch_layers + 1e-3, (fused, torch_layers)
    for layer in bf16.fused_layers:
        layer.window = None
    assert worst(bf16.fused_layers) > 5 * fused


def test_int4_load_runs_and_quantizes_experts_not_router(tiny, tmp_path):
    from nightshift.engine.quant.config import resolve_quant_config
    from nightshift.engine.quant.int4_linear import Int4Linear
    _, _, folder, _ = tiny
    check_int4(folder, tmp_path, prompt(20, 2))
    model = load_model(folder, quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path),
                       cpu_math="float32")
    moe = model.layers[0].mlp
    assert all(isinstance(e.gate_up_proj, Int4Linear) and isinstance(e.down_proj, Int4Linear) for e in moe.experts)
    assert moe.gate.dtype == torch.float32
    if moe.shared_expert is not None:
        assert isinstance(moe.shared_expert.gate_up_proj, Int4Linear) and isinstance(moe.shared_expert.down_proj,
                                                                                      Int4Linear)
        assert moe.shared_expert_gate.dtype == torch.float32


def test_experts_are_grouped_gemms_not_a_token_loop(tiny):
    """A step calls each used expert's projections once, whatever its number of tokens."""
    _, _, _, ours = tiny
    moe = ours.layers[0].mlp
    calls = []
    hooks = [e.gate_up_proj.register_forward_pre_hook(lambda m, a, e=i: calls.append((e, a[0].shape[0])))
             for i, e in enumerate(moe.experts)]
    try:
        x = torch.randn(50, ours.config.hidden_size)
        out = moe(x)
    finally:
        for h in hooks:
            h.remove()
    experts = [e for e, _ in calls]
    assert len(experts) == len(set(experts)) <= moe.num_experts
    assert sum(n for _, n in calls) == 50 * moe.top_k and out.shape == x.shape


MOE_CFG = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100}


def test_qwen3_moe_sparse_step_and_mlp_only_layers():
    cfg = {**MOE_CFG, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    parsed = ModelConfig.from_hf_config(cfg)
    assert [parsed.is_moe(i) for i in range(4)] == [False, True, False, False]
    assert not parsed.norm_topk_prob and parsed.expert_intermediate_size == 32
    assert not any(ModelConfig.from_hf_config({**cfg, "num_experts": 0}).is_moe(i) for i in range(4))
    sliding = ModelConfig.from_hf_config({**cfg, "use_sliding_window": True, "sliding_window": 16})
    assert [sliding.layer_window(i) for i in range(4)] == [16] * 4
    assert ModelConfig.from_hf_config({**cfg, "sliding_window": 16}).layer_window(0) is None


def test_qwen2_moe_sparse_layers_as_transformers_builds_them():
    """decoder_sparse_step and mlp_only_layers pick the same sparse layers as Qwen2MoeForCausalLM's own."""
    import transformers as tf
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    fields = dict(vocab_size=100, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  num_experts=4, num_experts_per_tok=2)
    for step, only in ((2, []), (1, [0, 4]), (3, [2]), (1, [])):
        config = tf.Qwen2MoeConfig(**fields, decoder_sparse_step=step, mlp_only_layers=only)
        hf = tf.Qwen2MoeForCausalLM(config)
        ours = ModelConfig.from_hf_config(config.to_dict())
        assert [ours.is_moe(i) for i in range(6)] == \
            [isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) for layer in hf.model.layers], (step, only)
        assert ours.shared_expert_intermediate_size == 24 and ours.attention_bias
    no_bias = ModelConfig.from_hf_config({**MOE_CFG, "model_type": "qwen2_moe", "num_experts": 4, "qkv_bias": False})
    assert not no_bias.attention_bias and no_bias.shared_expert_intermediate_size == 5632   # transformers' default
    none = ModelConfig.from_hf_config({**MOE_CFG, "model_type": "qwen2_moe", "num_experts": 4,
                                       "shared_expert_intermediate_size": 0})
    assert none.shared_expert_intermediate_size is None
    # the shared expert's matmuls count in the step's projections (CPU math chooses on them)
    with_shared = ModelConfig.from_hf_config({**MOE_CFG, "model_type": "qwen2_moe", "num_experts": 4,
                                              "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                              "shared_expert_intermediate_size": 24})
    assert with_shared.projection_shapes[:6] == ((192, 64), (64, 64), (32, 64), (64, 16), (32, 64), (64, 16)) \
        and with_shared.projection_shapes[6:8] == ((48, 64), (64, 24))


def test_unsupported_moe_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="deepseek_v3"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "deepseek_v3", "n_routed_experts": 4})
    with pytest.raises(ValueError, match="use_sliding_window=True without layer_types"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "qwen2_moe", "num_experts": 4,
                                    "use_sliding_window": True, "sliding_window": 16})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "qwen3_moe", "num_experts": 4,
                                    "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "mixtral", "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_config({**MOE_CFG, "model_type": "olmoe", "sliding_window": 16})
    mixtral = ModelConfig.from_hf_config({**MOE_CFG, "model_type": "mixtral", "sliding_window": 32})
    assert mixtral.num_experts == 8 and mixtral.norm_topk_prob and mixtral.layer_window(2) == 32


def test_qwen2_moe_sliding_layers_match_hf(tmp_path):
    """use_sliding_window with the layer_types transformers derives (layer 0 of 2 slides here): the
    window's layers attend through it, shorter than the prompt."""
    import transformers as tf
    torch.manual_seed(1)
    config = tf.Qwen2MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                               shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                               use_sliding_window=True, sliding_window=8, max_window_layers=2)
    reference = tf.Qwen2MoeForCausalLM(config).eval()
    randomize_norms(reference)
    decisive_routing(reference)
    ours = load_model(save(reference, tmp_path / "q2moe-window"), cpu_math="float32")
    assert [ours.config.layer_window(i) for i in range(2)] == [8, None]
    check_steps(ours, reference, prompt(30, 3), chunk=11)

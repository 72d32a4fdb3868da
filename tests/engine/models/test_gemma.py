"""Gemma 2 and Gemma 3 text against transformers' Gemma2ForCausalLM / Gemma3ForCausalLM float32
(checks: model_check.py): (1 + w) RMSNorms, sandwich norms, GeGLU, scaled embeddings, query scale
from query_pre_attn_scalar, sliding-window layers (window shorter than the prompts) alternating
with global ones, attention and final logit soft-capping (Gemma 2), local RoPE base, global
linear RoPE scaling and q/k norms (Gemma 3)."""
from __future__ import annotations

import pytest
import torch

from model_check import VOCAB, check_engine, check_int4, check_steps, prompt, randomize_norms, save
from nightshift.engine.attention import AttentionOptions, select_attention_backend
from nightshift.engine.loader import load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import GemmaForCausalLM

pytestmark = pytest.mark.slow

WINDOW = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=24,
              rms_norm_eps=1e-6)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # soft-capping low enough to bite on random weights
    return Gemma2ForCausalLM(Gemma2Config(**COMMON, num_hidden_layers=4, attn_logit_softcapping=2.0,
                                          final_logit_softcapping=3.0, attn_implementation="eager"))


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    config = Gemma3TextConfig(**COMMON, num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                                          "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                              attn_implementation="eager")
    return Gemma3ForCausalLM(config)


MAKERS = {"gemma2": gemma2, "gemma3": gemma3}


@pytest.fixture(scope="module", params=list(MAKERS))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    reference = MAKERS[request.param]().eval()
    randomize_norms(reference)
    with torch.no_grad():      # larger q/k so that the soft-capping and the window matter
        for layer in reference.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    folder = save(reference, tmp_path_factory.mktemp(request.param))
    return request.param, reference, folder, load_model(folder, cpu_math="float32")


def test_config_and_class(tiny):
    name, _, _, ours = tiny
    assert isinstance(ours, GemmaForCausalLM)
    cfg = ours.config
    assert cfg.attention_scale == 24 ** -0.5 and cfg.needs_masked_attention
    if name == "gemma2":
        assert cfg.architecture == "gemma2" and not cfg.qk_norm
        assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 3.0)
        assert ours.layer_rope == ["global"] * 4
    else:
        assert cfg.architecture == "gemma3_text" and cfg.qk_norm
        assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
        assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_local_base_freq == 10000.0
        assert ours.layer_rope == ["local", "local", "global", "local"]


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_prefill_and_decode_logits_match_hf(tiny, cpu_kernel):
    _, reference, _, ours = tiny
    check_steps(ours, reference, prompt(45, 1), chunk=16, cpu_kernel=cpu_kernel)   # 45 > WINDOW


def test_engine_batch_prefix_cache_chunked_matches_hf(tiny):
    _, reference, _, ours = tiny
    check_engine(ours, reference)


def test_fused_bf16_layers_follow_hf_as_the_torch_layers_do(tiny):
    """On the bf16 CPU math a Gemma layer runs as fused_cpu_layer.FusedGemmaCpuLayer ((1 + w)
    norms, sandwich norms, GeGLU, Gemma 3's q/k norms; the window and the soft-capping applied by
    the attention kernel): over two prefill chunks and decode steps past the window its logits
    stay as close to HF float32 as the torch layers on the same bf16 math; without the window or
    the soft-capping they would not."""
    from nightshift.engine.kernels import cpu_fused_ops
    from nightshift.engine.model_runner import ModelRunner
    from nightshift.engine.models.fused_cpu_layer import FusedGemmaCpuLayer
    from nightshift.engine.step import StepItem
    from nightshift.engine.layers import cpu_math
    if cpu_fused_ops.load() is None:
        pytest.skip("no C compiler: the torch layers run")
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here (oneDNN refuses bfloat16 weights on an AVX2-only CPU)")
    name, reference, folder, _ = tiny
    bf16 = load_model(folder, cpu_math="bf16")
    assert bf16.fused_layers is not None and all(type(f) is FusedGemmaCpuLayer for f in bf16.fused_layers)
    ids = prompt(50, 4)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    runner = ModelRunner(bf16, num_kv_blocks=8, block_size=16)
    steps = [(ids[:20], 0), (ids[20:45], 20)] + [([ids[p]], p) for p in range(45, 50)]

    def worst(layers) -> float:
        saved, bf16.fused_layers = bf16.fused_layers, layers
        try:
            return max((runner.execute([StepItem(tokens, start, [0, 1, 2, 3])])[0]
                        - expected[start + len(tokens) - 1]).abs().max().item() for tokens, start in steps)
        finally:
            bf16.fused_layers = saved

    fused, torch_layers = worst(bf16.fused_layers), worst(None)
    assert fused <= 1.5 * torch_layers + 1e-3, (fused, torch_layers)
    for layer in bf16.fused_layers:
        layer.window = None
        layer.softcap = None
    assert worst(bf16.fused_layers) > 5 * fused


def test_int4_load_runs(tiny, tmp_path):
    _, _, folder, _ = tiny
    check_int4(folder, tmp_path, prompt(20, 2))


def test_triton_backend_is_refused_and_auto_takes_torch(tiny):
    _, _, _, ours = tiny
    with pytest.raises(ValueError, match="Triton attention backend cannot serve"):
        select_attention_backend(ours.config, 16, torch.float32, torch.device("cpu"), AttentionOptions("triton"))
    backend = select_attention_backend(ours.config, 16, torch.float32, torch.device("cuda"), AttentionOptions("auto"))
    assert backend.name == "torch"


def test_unsupported_fields_are_refused():
    base = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "sliding_window": 8}
    assert ModelConfig.from_hf_config(base).layer_types == ["sliding_attention"] * 2   # pattern 6
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_hf_config({**base, "hidden_activation": "gelu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**base, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="rope_parameters.sliding_attention"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    gemma2 = {**base, "model_type": "gemma2"}
    assert ModelConfig.from_hf_config(gemma2).layer_types == ["sliding_attention", "full_attention"]

"""Qwen3 (per-head q/k RMSNorm before RoPE, head_dim of its own, no qkv bias) against
transformers' Qwen3ForCausalLM float32 (checks: model_check.py)."""
from __future__ import annotations

import pytest
import torch

from model_check import VOCAB, check_engine, check_int4, check_steps, prompt, randomize_norms, save
from nightshift.engine.loader import load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models import Qwen3ForCausalLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM as HFQwen3
    torch.manual_seed(0)
    # head_dim 32 with hidden 64 and 4 heads: not hidden / heads
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=1000000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    reference = HFQwen3(config).eval()
    randomize_norms(reference)
    folder = save(reference, tmp_path_factory.mktemp("qwen3"))
    return reference, folder, load_model(folder, cpu_math="float32")


def test_config_and_class(tiny):
    _, _, ours = tiny
    assert isinstance(ours, Qwen3ForCausalLM)
    cfg = ours.config
    assert cfg.architecture == "qwen3" and cfg.qk_norm and cfg.head_dim == 32 and not cfg.attention_bias
    assert ours.layers[0].self_attn.q_norm.weight.shape == (32,)


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_prefill_and_decode_logits_match_hf(tiny, cpu_kernel):
    reference, _, ours = tiny
    check_steps(ours, reference, prompt(45, 1), chunk=16, cpu_kernel=cpu_kernel)


def test_engine_batch_prefix_cache_chunked_matches_hf(tiny):
    reference, _, ours = tiny
    check_engine(ours, reference)


def test_fused_bf16_layers_apply_the_qk_norms(tiny):
    """On the bf16 CPU math the Qwen3 layer runs as the fused C layer (models/fused_cpu_layer.py:
    the per-head q/k RMSNorms inside rope_store); its logits follow HF float32 as closely as the
    torch layers on the same bf16 math do, and with the q/k norms left out they would not."""
    from nightshift.engine.kernels import cpu_fused_ops
    from nightshift.engine.model_runner import ModelRunner
    from nightshift.engine.step import StepItem
    from nightshift.engine.layers import cpu_math
    if cpu_fused_ops.load() is None:
        pytest.skip("no C compiler: the torch layers run")
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here (oneDNN refuses bfloat16 weights on an AVX2-only CPU)")
    reference, folder, _ = tiny
    bf16 = load_model(folder, cpu_math="bf16")
    assert bf16.fused_layers is not None and bf16.fused_layers[0].qk_norm is not None
    ids = prompt(40, 3)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    runner = ModelRunner(bf16, num_kv_blocks=8, block_size=16)

    def last_logits(layers):
        saved, bf16.fused_layers = bf16.fused_layers, layers
        try:
            return runner.execute([StepItem(ids, 0, [0, 1, 2])])[0]
        finally:
            bf16.fused_layers = saved

    fused, torch_layers = last_logits(bf16.fused_layers), last_logits(None)
    err_fused, err_torch = (fused - expected).abs().max().item(), (torch_layers - expected).abs().max().item()
    assert err_fused <= 1.5 * err_torch + 1e-3, (err_fused, err_torch)
    for layer in bf16.fused_layers:
        layer.qk_norm = None                  # what ignoring the norms would give: far off
    assert (last_logits(bf16.fused_layers) - expected).abs().max().item() > 10 * err_fused


def test_int4_load_runs(tiny, tmp_path):
    _, folder, _ = tiny
    check_int4(folder, tmp_path, prompt(20, 2))


def test_sliding_window_config_is_honoured_not_ignored():
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100, "use_sliding_window": True, "sliding_window": 16,
           "max_window_layers": 2}
    parsed = ModelConfig.from_hf_config(cfg)
    assert [parsed.layer_window(i) for i in range(4)] == [None, None, 16, 16]
    assert ModelConfig.from_hf_config({**cfg, "use_sliding_window": False}).layer_window(3) is None
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config({**cfg, "hidden_act": "gelu"})

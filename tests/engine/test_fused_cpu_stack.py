"""A small step's whole stack of fused CPU layers in one C call (engine/models/fused_cpu_stack.py):
the same logits, bit for bit, as the fused layers called one by one from Python, on the INT4
default model (Llama) and on tiny INT4 Qwen3 (per-head q/k norms), Qwen2 (q/k/v bias), Gemma 2 and
Gemma 3 models;
steps above its row limit, other models and NIGHTSHIFT_CPU_FUSED_STACK=0 keep the Python loop."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.layers import cpu_math
from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.models import fused_cpu_stack
from nightshift.engine.quant import cpu_w4_bf16
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.step import StepItem

pytestmark = pytest.mark.slow
bf16_math = pytest.mark.skipif(cpu_fused_ops.load() is None or not cpu_w4_bf16.available()
                               or "bf16" not in cpu_math.supported(),
                               reason="needs the fused CPU layers on the bf16 math (AVX-512 BF16) and the W4 x bf16 kernel")


def int4_model(path: str, cache_dir):
    return load_model(path, dtype=torch.float32, cpu_math="bf16", quant_config=resolve_quant_config("int4"),
                      cache_dir=str(cache_dir))


class Counting:
    """The model's stack, counting the steps it ran."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def runs(self, rows):
        return self.stack.runs(rows)

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


def decode_steps(runner, prompts, forced, stack) -> tuple[torch.Tensor, int]:
    """Every step's logits (the prompts prefilled, then teacher-forced decode steps of all rows, then
    of the first row alone) with `stack` as the runner's model's (None: the Python loop), and how
    many steps it ran (each call writes every pool slot it reads)."""
    model = runner.model
    counting = None if stack is None else Counting(stack)
    saved, model.fused_stack = model.fused_stack, counting
    try:
        tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(prompts))]
        steps = [runner.execute([StepItem(p, 0, t) for p, t in zip(prompts, tables)])]
        for step in range(len(forced[0])):
            steps.append(runner.execute([StepItem([f[step]], len(p) + step, t)
                                         for f, p, t in zip(forced, prompts, tables)]))
        start = len(prompts[0]) + len(forced[0])
        for step, token in enumerate(forced[0][:3]):
            steps.append(runner.execute([StepItem([token], start + step, tables[0])]))
        return torch.cat(steps), (0 if counting is None else counting.calls)
    finally:
        model.fused_stack = saved


def check_same_bits(model, rows: int = 3, seed: int = 0) -> None:
    assert model.fused_stack is not None
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (37, 20, 55, 8)[:rows]]
    forced = [torch.randint(100, 40000, (5,), generator=g).tolist() for _ in prompts]
    runner = ModelRunner(model, num_kv_blocks=48, block_size=16)
    with_stack, ran = decode_steps(runner, prompts, forced, model.fused_stack)
    python_loop, _ = decode_steps(runner, prompts, forced, None)
    assert ran == 5 + 3                          # every decode step, not the prefill
    assert torch.isfinite(with_stack).all() and torch.equal(with_stack, python_loop)


@pytest.fixture(scope="module")
def default_int4(default_model_path, tmp_path_factory):
    return int4_model(default_model_path, tmp_path_factory.mktemp("int4-cache"))


@bf16_math
def test_the_default_int4_model_gets_the_same_bits_in_one_call(default_int4):
    stack = default_int4.fused_stack
    assert stack is not None and len(stack.layers) == default_int4.config.num_layers
    assert stack.runs(1) and stack.runs(8) and not stack.runs(9) and not stack.runs(0)
    check_same_bits(default_int4, rows=3)


@bf16_math
def test_a_new_weight_is_read_not_the_one_first_packed(default_int4):
    """A projection given a new weight after the stack ran rebuilds its kernel form; the stack must
    follow it (on the same runner: both paths still agree, and the logits changed)."""
    runner = ModelRunner(default_int4, num_kv_blocks=48, block_size=16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (30,), generator=g).tolist()]
    forced = [torch.randint(100, 40000, (5,), generator=g).tolist()]
    before, _ = decode_steps(runner, prompts, forced, default_int4.fused_stack)
    down = default_int4.layers[3].mlp.down_proj
    original = down.int4_weight
    try:
        down.set_weight(quantize_rtn(torch.randn(down.out_features, down.in_features) * 0.05, down.group_size))
        after, _ = decode_steps(runner, prompts, forced, default_int4.fused_stack)
        python_loop, _ = decode_steps(runner, prompts, forced, None)
        assert torch.equal(after, python_loop) and not torch.equal(after, before)
    finally:
        down.set_weight(original)


@bf16_math
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qk_norms_and_qkv_bias_go_through_the_stack(arch, tmp_path):
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if arch == "qwen3":
        reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=64, **common))
    else:
        reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.3)
    reference.eval().save_pretrained(tmp_path / "model")
    model = int4_model(str(tmp_path / "model"), tmp_path / "cache")
    layer = model.fused_layers[0]
    assert (layer.qk_norm is not None) if arch == "qwen3" else (layer.qkv_bias is not None)
    check_same_bits(model, rows=4)


def tiny_gemma(arch: str, folder) -> str:
    """A tiny random Gemma 2 or Gemma 3 (4 layers, windows of 12 alternating with global layers;
    Gemma 2's soft-capping, Gemma 3's q/k norms and local RoPE base; norms moved off their
    defaults) saved as a HF folder; its path."""
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=12,
                  query_pre_attn_scalar=24, rms_norm_eps=1e-6, attn_implementation="eager")
    if arch == "gemma2":
        reference = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0))
    else:
        reference = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    reference.eval().save_pretrained(folder)
    return str(folder)


@bf16_math
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_layers_go_through_the_stack(arch, tmp_path):
    """Gemma's form (sandwich norms, GeGLU), its sliding windows shorter than the prompts,
    alternating with global layers, Gemma 2's attention soft-capping, Gemma 3's q/k norms and local
    RoPE table."""
    model = int4_model(tiny_gemma(arch, tmp_path / "model"), tmp_path / "cache")
    assert {layer.window for layer in model.fused_layers} == {12, None}
    if arch == "gemma3":
        assert model.fused_layers[0].qk_norm is not None and len(model.rotary) == 2
    check_same_bits(model, rows=4)


@bf16_math
def test_where_it_does_not_apply(default_model_path, monkeypatch, default_int4):
    dense = load_model(default_model_path, dtype=torch.float32, cpu_math="bf16")
    assert dense.fused_layers is not None and dense.fused_stack is None       # bf16 projections: torch's matmul
    monkeypatch.setenv(fused_cpu_stack.ENV, "0")
    assert fused_cpu_stack.build(default_int4) is None


# Under the float32 CPU math (AVX2 CPUs; any CPU told so) the model runs its torch layers and a
# float32 K/V pool; its small steps still go through the stack, whose layers are fused forms of the
# torch layers that only it runs. Wherever the W4 x bf16 kernel builds (AVX2 with FMA, or AVX-512 BF16).
float32_math = pytest.mark.skipif(cpu_fused_ops.load() is None or not cpu_w4_bf16.available(),
                                  reason="needs the fused CPU kernels and the W4 x bf16 kernel")


def float32_int4_model(path: str, cache_dir):
    return load_model(path, dtype=torch.float32, cpu_math="float32", quant_config=resolve_quant_config("int4"),
                      cache_dir=str(cache_dir))


class LayerByLayer:
    """The stack's steps through its layers called one by one from Python."""

    def __init__(self, model, attention):
        self.stack, self.layer_rope, self.attention = model.fused_stack, model.layer_rope, attention

    def runs(self, rows):
        return self.stack.runs(rows)

    def __call__(self, x, rope, kv_caches, meta):
        for layer, kv_cache, which in zip(self.stack.layers, kv_caches, self.layer_rope):
            x = layer(x, *rope[which], kv_cache, self.attention, meta)
        return x


def check_float32_math(model, rows: int = 3, seed: int = 0) -> None:
    """The stack's bits are its layers' run one by one from Python; both are the torch layers'
    small steps up to float32 summation order (the same bfloat16 roundings, at a projection's input
    and output), over the same float32 pool."""
    stack = model.fused_stack
    assert model.fused_layers is None and stack is not None and model.kv_dtype == torch.float32
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (37, 20, 55, 8)[:rows]]
    forced = [torch.randint(100, 40000, (5,), generator=g).tolist() for _ in prompts]
    runner = ModelRunner(model, num_kv_blocks=48, block_size=16)
    assert runner.kv_dtype == torch.float32
    with_stack, ran = decode_steps(runner, prompts, forced, stack)
    assert ran == 5 + 3
    layer_by_layer, _ = decode_steps(runner, prompts, forced, LayerByLayer(model, runner.attention))
    torch_layers, _ = decode_steps(runner, prompts, forced, None)
    assert torch.isfinite(with_stack).all() and torch.equal(with_stack, layer_by_layer)
    decode = slice(rows, None)                         # the prefill's rows ran the torch layers in both
    assert torch.equal(with_stack[:rows], torch_layers[:rows])
    diff = (with_stack[decode] - torch_layers[decode]).abs().max().item()
    assert 0 < diff <= 0.05 * torch_layers[decode].abs().max().item()
    agree = (with_stack[decode].argmax(-1) == torch_layers[decode].argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.fixture(scope="module")
def float32_int4(default_model_path, tmp_path_factory):
    return float32_int4_model(default_model_path, tmp_path_factory.mktemp("int4-f32-cache"))


@float32_math
def test_under_the_float32_math_small_steps_run_the_stack_over_a_float32_pool(float32_int4):
    assert float32_int4.fused_stack.runs(1) and not float32_int4.fused_stack.runs(9)
    check_float32_math(float32_int4, rows=3)


@float32_math
def test_under_the_float32_math_gemma_3_runs_the_stack(tmp_path):
    model = float32_int4_model(tiny_gemma("gemma3", tmp_path / "model"), tmp_path / "cache")
    assert {layer.window for layer in model.fused_stack.layers} == {12, None}
    check_float32_math(model, rows=4)


@float32_math
def test_under_the_float32_math_w4a8_and_dense_models_keep_their_layers(default_model_path, tmp_path):
    dense = load_model(default_model_path, dtype=torch.float32, cpu_math="float32")
    assert dense.fused_layers is None and dense.fused_stack is None          # full precision: one path for every step
    w4a8 = load_model(default_model_path, dtype=torch.float32, cpu_math="float32", cpu_int4="w4a8",
                      quant_config=resolve_quant_config("int4"), cache_dir=str(tmp_path))
    assert w4a8.fused_layers is not None and w4a8.fused_stack is None        # one kernel for every step size

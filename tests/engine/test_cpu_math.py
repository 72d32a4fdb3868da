"""The CPU math paths of a float32 model's linear layers (engine/layers/cpu_math.py) and their choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.layers import cpu_gemm, cpu_math
from nightshift.engine.layers.linear import DenseLinear

# how far each path may be from float32 F.linear, relative to the output's scale
TOLERANCE = {"float32": 1e-5, "bf16": 2e-2, "int8": 3e-2}


def supported_maths():
    return [pytest.param(m, marks=pytest.mark.skipif(m not in cpu_math.supported(), reason=f"no native {m} here"))
            for m in cpu_math.MATHS]


@pytest.mark.parametrize("math", supported_maths())
def test_each_path_multiplies_as_f_linear_does_within_its_rounding(math):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(2, 7, 64, generator=generator)
    layer = DenseLinear(weight.clone(), bias, math=math)
    assert layer.math == math and layer.dense is None
    out = layer(x)
    expected = F.linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (2, 7, 96)
    assert (out - expected).abs().max().item() <= TOLERANCE[math] * expected.abs().max().item()
    assert layer.weight.shape == (96, 64)
    torch.testing.assert_close(layer.weight, weight, atol=TOLERANCE[math] * weight.abs().max().item(), rtol=0)


@pytest.mark.parametrize("in_features", [576, 1536])
@pytest.mark.parametrize("math", supported_maths())
def test_a_rows_result_does_not_depend_on_the_other_rows_of_the_step(math, in_features):
    """A request's answer must not depend on the batch around it: every path's row results are
    bit-identical whatever rows share the call, where the path says so (all but bf16 on AMX, where
    they differ only by bf16 rounding)."""
    generator = torch.Generator().manual_seed(1)
    layer = DenseLinear(torch.randn(320, in_features, generator=generator), None, math=math)
    x = torch.randn(300, in_features, generator=generator)
    full = layer(x)
    parts = [(x[:rows], full[:rows]) for rows in (1, 2, 3, 16, 17, 64, 255)] + [(x[31:71], full[31:71])]
    if cpu_math.row_independent(math):
        for part, expected in parts:
            assert torch.equal(layer(part), expected), len(part)
    else:
        for part, expected in parts:
            assert (layer(part) - expected).abs().max() <= TOLERANCE[math] * expected.abs().max()


def test_only_bf16_on_amx_is_not_row_independent(monkeypatch):
    assert cpu_math.row_independent("float32") and cpu_math.row_independent("int8")
    monkeypatch.setattr(cpu_math, "cpu_has_native_bf16", lambda: False)
    assert cpu_math.row_independent("bf16")
    monkeypatch.setattr(cpu_math, "cpu_has_native_bf16", lambda: True)
    assert not cpu_math.row_independent("bf16")


def test_the_float32_path_is_the_packed_onednn_one_bit_for_bit():
    if not cpu_gemm.available():
        pytest.skip("torch built without oneDNN")
    weight, x = torch.randn(40, 24), torch.randn(5, 24)
    packed = cpu_gemm.pack(weight)
    assert torch.equal(DenseLinear(weight.clone(), None, math="float32")(x), cpu_gemm.linear(x, packed))


def test_other_dtypes_keep_f_linear_and_no_math():
    weight = torch.randn(8, 8, dtype=torch.bfloat16)
    layer = DenseLinear(weight, None, math="bf16")
    assert layer.math is None and layer.packed is None
    assert not cpu_math.applies(weight, "int8")


def test_the_environment_variable_forces_a_path_and_refuses_others(monkeypatch):
    monkeypatch.setenv(cpu_math.ENV, "BF16")
    assert cpu_math.requested() == "bf16"
    assert cpu_math.choose(((8, 8),)) == cpu_math.Choice("bf16", "forced")
    monkeypatch.setenv(cpu_math.ENV, "fp8")
    with pytest.raises(ValueError, match="NIGHTSHIFT_CPU_MATH='fp8'.*float32, bf16, int8, auto"):
        cpu_math.requested()
    monkeypatch.delenv(cpu_math.ENV)
    assert cpu_math.requested() == "auto"
    with pytest.raises(ValueError, match="unknown CPU math 'int4'"):
        cpu_math.choose(((8, 8),), "int4")


def test_auto_keeps_the_fastest_allowed_path_and_measures_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("NIGHTSHIFT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_math.ENV, raising=False)
    monkeypatch.setattr(cpu_math, "supported", lambda: ("float32", "bf16", "int8"))
    timed = []
    fake = {"float32": 1.0, "bf16": 0.5, "int8": 0.1}

    def time_math(shapes, math):
        timed.append(math)
        return fake[math]
    monkeypatch.setattr(cpu_math, "_time_math", time_math)
    choice = cpu_math.choose(((64, 32), (32, 64)))
    # int8 is fastest but drifts more than HF bf16 on the quality prompts: never chosen by auto
    assert choice.math == "bf16" and choice.reason == "measured" and "int8" not in choice.seconds
    assert sorted(timed) == ["bf16", "float32"]
    assert cpu_math.choose(((64, 32), (32, 64))) == choice and len(timed) == 2     # from the disk cache
    fake["bf16"] = 0.97                                                           # not MARGIN faster
    assert cpu_math.choose(((64, 64),)).math == "float32"


def test_auto_measures_real_paths_on_this_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("NIGHTSHIFT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_math.ENV, raising=False)
    choice = cpu_math.choose(((96, 64), (64, 96)))
    candidates = [m for m in cpu_math.AUTO_MATHS if m in cpu_math.supported()]
    assert choice.math in candidates
    if len(candidates) > 1:
        assert set(choice.seconds) == set(candidates) and all(s > 0 for s in choice.seconds.values())
        assert choice.describe().startswith(f"{choice.math} (measured: float32 ")


def test_int4_kernel_is_dense_unless_w4a8_is_asked_for(monkeypatch):
    from nightshift.engine.quant import cpu_w4a8

    monkeypatch.delenv(cpu_math.INT4_ENV, raising=False)
    assert cpu_math.choose_int4().math == "dense"              # w4a8 drifts more than HF bf16: never auto
    monkeypatch.setattr(cpu_w4a8, "available", lambda: True)
    monkeypatch.setenv(cpu_math.INT4_ENV, "W4A8")
    assert cpu_math.choose_int4() == cpu_math.Choice("w4a8", "forced")
    assert cpu_math.choose_int4("dense") == cpu_math.Choice("dense", "forced")     # the argument wins
    monkeypatch.setenv(cpu_math.INT4_ENV, "int2")
    with pytest.raises(ValueError, match="NIGHTSHIFT_CPU_INT4='int2': choose one of dense, w4a8, auto"):
        cpu_math.choose_int4()
    monkeypatch.setattr(cpu_w4a8, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs an x86 CPU with AVX2"):
        cpu_math.choose_int4("w4a8")


TEXTS = ("The moon is Earth's only natural satellite. It orbits at an average distance of about 384,400 "
         "kilometres and always shows the same face to us, because its rotation is tidally locked.",
         "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
         "glucose and oxygen. It takes place mostly in the leaves, inside the chloroplasts, and it feeds "
         "almost every food chain on land.",
         "A binary search tree keeps its keys in order: every key in a node's left subtree is smaller than the "
         "node's key and every key in its right subtree is larger, so a lookup halves the search each step.",
         "Honeybees live in colonies of tens of thousands of workers, a few hundred drones and one queen. The "
         "workers gather nectar and pollen, build the comb, guard the entrance and care for the young.")


def test_the_lm_head_is_q8_only_on_bf16_with_q8_0_blocks_and_where_it_measures_faster(monkeypatch, tmp_path):
    from nightshift.engine.quant import cpu_w8a8

    monkeypatch.setenv("NIGHTSHIFT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_math.HEAD_ENV, raising=False)
    monkeypatch.setattr(cpu_w8a8, "available", lambda: True)
    timed = []
    fake = {"dense": 1.0, "q8": 0.6}

    def time_head(shape, form):
        timed.append(form)
        return fake[form]
    monkeypatch.setattr(cpu_math, "_time_head", time_head)
    choice = cpu_math.choose_head("bf16", (512, 64), True)
    assert choice.math == "q8" and choice.reason == "measured" and sorted(timed) == ["dense", "q8"]
    assert choice.describe() == "q8 (measured: dense 1000.0 ms, q8 600.0 ms for the probe steps)"
    assert cpu_math.choose_head("bf16", (512, 64), True) == choice and len(timed) == 2    # from the disk cache
    fake["q8"] = 0.97                                                                      # not MARGIN faster
    assert cpu_math.choose_head("bf16", (256, 64), True).math == "dense"
    # the float32 path stays exact; a checkpoint without Q8_0 blocks of the head has nothing to read
    assert cpu_math.choose_head("float32", (512, 64), True) == cpu_math.Choice("dense", "no Q8_0 head here")
    assert cpu_math.choose_head("bf16", (512, 64), False) == cpu_math.Choice("dense", "no Q8_0 head here")
    assert len(timed) == 4
    monkeypatch.setenv(cpu_math.HEAD_ENV, "Q8")
    assert cpu_math.choose_head("bf16", (512, 64), True) == cpu_math.Choice("q8", "forced")
    assert cpu_math.choose_head("bf16", (512, 64), True, "dense") == cpu_math.Choice("dense", "forced")
    with pytest.raises(RuntimeError, match="needs the bf16 CPU math \\(this model's is float32\\)"):
        cpu_math.choose_head("float32", (512, 64), True)
    with pytest.raises(RuntimeError, match="has_q8_blocks=False"):
        cpu_math.choose_head("bf16", (512, 64), False)
    monkeypatch.setenv(cpu_math.HEAD_ENV, "int4")
    with pytest.raises(ValueError, match="NIGHTSHIFT_CPU_HEAD='int4': choose one of dense, q8, auto"):
        cpu_math.choose_head("bf16", (512, 64), True)


def test_the_lm_head_choice_measures_both_real_forms_on_this_machine(monkeypatch, tmp_path):
    from nightshift.engine.quant import cpu_w8a8

    if "bf16" not in cpu_math.supported() or not cpu_w8a8.available():
        pytest.skip("no bf16 CPU math or W8A8 kernel here: the head is never q8")
    monkeypatch.setenv("NIGHTSHIFT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_math.HEAD_ENV, raising=False)
    choice = cpu_math.choose_head("bf16", (4096, 576), True)
    assert choice.reason == "measured" and set(choice.seconds) == {"dense", "q8"}
    assert all(s > 0 for s in choice.seconds.values())
    assert choice.math == ("q8" if choice.seconds["q8"] < (1 - cpu_math.MARGIN) * choice.seconds["dense"] else "dense")


def real_model_paths():
    """(math, LM head form) of every native path but float32's; bf16 with each head form."""
    params = []
    for p in supported_maths():
        math = p.values[0]
        if math == "bf16":
            params += [pytest.param(math, "dense", marks=p.marks, id="bf16-dense-head"),
                       pytest.param(math, "q8", marks=p.marks, id="bf16-q8-head")]
        elif math != "float32":
            params.append(pytest.param(math, None, marks=p.marks, id=math))
    return params


@pytest.mark.parametrize("math, head", real_model_paths())
def test_the_real_model_on_each_path_follows_float32(math, head, fp32_model, default_model_path, monkeypatch):
    """Teacher-forced next-token choices of the default model on another path agree with the
    float32 path's (bench.quality --maths measures the drift against HF float32 in full); on bf16,
    with the math's own LM head and with the GGUF's Q8_0 head against int8 activations."""
    from nightshift.engine.loader import load_model
    from nightshift.engine.model_runner import ModelRunner
    from nightshift.engine.quant import cpu_w8a8
    from nightshift.engine.step import StepItem
    from nightshift.engine.tokenizer import load_tokenizer

    if head == "q8" and not cpu_w8a8.available():
        pytest.skip("no W8A8 kernel here")
    if head is not None:
        monkeypatch.setenv(cpu_math.HEAD_ENV, head)
    model = load_model(default_model_path, dtype=torch.float32, cpu_math=math)
    assert model.cpu_math == cpu_math.Choice(math, "forced")
    assert model.cpu_head == (None if head is None else cpu_math.Choice(head, "forced"))
    assert model.q8_head_int8 == (head == "q8") and (model.lm_head is None) == (head == "q8")
    tokenizer = load_tokenizer(default_model_path)
    texts = [tokenizer.encode(text) for text in TEXTS]
    prompts, forced = [t[:10] for t in texts], [t[10:34] for t in texts]
    assert all(len(f) == 24 for f in forced)
    choices = {}
    for name, net in (("float32", fp32_model), (math, model)):
        runner = ModelRunner(net, num_kv_blocks=24, block_size=16)
        tables = [list(range(6 * i, 6 * i + 6)) for i in range(4)]
        items = [StepItem(p, 0, t) for p, t in zip(prompts, tables)]
        steps = []
        for step in range(24):
            steps.append(runner.execute(items).argmax(-1))
            items = [StepItem([f[step]], len(p) + step, t) for f, p, t in zip(forced, prompts, tables)]
        choices[name] = torch.stack(steps)
    agreement = (choices["float32"] == choices[math]).float().mean().item()
    assert agreement >= {"bf16": 0.9, "int8": 0.75}[math], agreement
    # a step of argmaxes only takes the logits as the head computes them: on bf16, its bfloat16
    # values, which the float32 logits are widened (LlamaForCausalLM.project_logits)
    narrow = runner.execute(items, float_logits=False)
    assert narrow.dtype == (torch.bfloat16 if head == "dense" else torch.float32)
    assert torch.equal(narrow.float(), runner.execute(items))
    from nightshift.engine.engine import Engine
    engine = Engine.from_model(model, tokenizer, "m", max_num_seqs=2, num_kv_blocks=8)
    fused = ", fused layers, bfloat16 K/V" if math == "bf16" else ""     # models/fused_cpu_layer.py
    from nightshift.engine.kernels import cpu_prefix_attention
    shape = model.config
    if math == "bf16" and cpu_prefix_attention.supports(shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                        torch.bfloat16):
        fused += ", shared prefixes on AMX tiles"                        # an AMX CPU
    head = f", LM head {head} (forced)" if head else ""
    assert engine.compute == f"cpu float32, CPU math {math} (forced){head}{fused}"

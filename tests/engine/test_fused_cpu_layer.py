"""The bf16 CPU layer as fused kernels (engine/models/fused_cpu_layer.py) on the real default model:
the same answers as the torch layers on the same bf16 math (up to float32 summation order), a row's
logits independent of the rows beside it, and the torch layers wherever a piece does not fit."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.layers import cpu_math
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.models import fused_cpu_layer
from nightshift.engine.quant import cpu_w4a8
from nightshift.engine.step import StepItem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpu_fused_ops.load() is None, reason="no C compiler: the torch layers run")]
# the bf16 math needs bf16 dot products (oneDNN refuses bfloat16 weights on an AVX2-only CPU)
needs_bf16 = pytest.mark.skipif("bf16" not in cpu_math.supported(), reason="no bf16 CPU math here")
needs_w4a8 = pytest.mark.skipif(not cpu_w4a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")


@pytest.fixture(scope="module")
def bf16_model(default_model_path):
    from nightshift.engine.loader import load_model
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here")
    return load_model(default_model_path, dtype=torch.float32, cpu_math="bf16")


def schedule(runner: ModelRunner, fused_layers, prompts, forced):
    """Logits of every step: the prompts prefilled in two chunks beside decoding rows, then
    teacher-forced decode steps (the same tokens whichever layers run)."""
    model = runner.model
    saved, model.fused_layers = model.fused_layers, fused_layers
    try:
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
        half = len(prompts[0]) // 2
        steps = [runner.execute([StepItem(prompts[0][:half], 0, tables[0])]),
                 runner.execute([StepItem(prompts[0][half:], half, tables[0])] +
                                [StepItem(p, 0, t) for p, t in zip(prompts[1:], tables[1:])])]
        for step in range(len(forced[0])):
            steps.append(runner.execute([StepItem([f[step]], len(p) + step, t)
                                         for f, p, t in zip(forced, prompts, tables)]))
        return torch.cat(steps)
    finally:
        model.fused_layers = saved


def kl(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


def test_fused_layers_follow_float32_as_closely_as_the_torch_layers(bf16_model, fp32_model):
    """Both bf16 forms against the float32 model on the same schedule (both over the runner's
    bfloat16 K/V pool): the fused layers drift from it no more than the torch layers on the same
    bf16 math do (they round at the same places)."""
    assert bf16_model.fused_layers is not None and len(bf16_model.fused_layers) == bf16_model.config.num_layers
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 23, 71, 9)]
    forced = [torch.randint(100, 40000, (12,), generator=g).tolist() for _ in prompts]
    runner = ModelRunner(bf16_model, num_kv_blocks=40, block_size=16)
    assert runner.attention.name == fused_cpu_layer.BACKEND
    assert runner.kv_dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.kv_bytes_per_block * 2 == ModelRunner(fp32_model, num_kv_blocks=1).kv_bytes_per_block
    fused = schedule(runner, bf16_model.fused_layers, prompts, forced)
    torch_layers = schedule(runner, None, prompts, forced)
    reference = schedule(ModelRunner(fp32_model, num_kv_blocks=40, block_size=16), None, prompts, forced)
    assert kl(fused, reference) <= 1.25 * kl(torch_layers, reference), (kl(fused, reference), kl(torch_layers, reference))
    # the float32 top-1 wherever float32 leads by more than 0.5 (four bfloat16 steps at these logits,
    # ~15-30: both bf16 forms round the LM head's output to bfloat16, so a smaller lead can become an
    # exact tie, broken by index; and where the CPU has AVX-512 BF16 the attention multiplies in
    # bfloat16 as HF's bfloat16 attention does, cpu_paged_attention.bf16_products). On a 2-core AMX
    # Xeon the fused form's top-1 differed on 5 of 53 random-token rows, each an exact tie in its
    # bfloat16 logits at a float32 lead of 0.05-0.10 (the torch layers' on 1, also a tie), which the
    # rule before (a top-1 share within 5 points of the torch layers') did not allow. On a 2-core AMD
    # EPYC Zen 4 the largest loss of float32's lead on these rows was 0.10 (fused) / 0.23 (torch
    # layers) with float32 attention products, 0.30 / 0.43 with bfloat16 ones (KL 1.45e-3 / 1.51e-3
    # -> 1.73e-3 / 1.72e-3; on real prompts, `bench.quality --maths bf16`, the KL moved 6.68e-4 ->
    # 6.50e-4, HF bfloat16's 1.17e-3)
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert clear.sum() >= 20, clear.sum()
    for name, x in (("fused", fused), ("torch", torch_layers)):
        assert torch.equal(x.argmax(-1)[clear], reference.argmax(-1)[clear]), name


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(bf16_model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (30, 55, 12)]
    runner = ModelRunner(bf16_model, num_kv_blocks=40, block_size=16)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    runner.execute([StepItem(p, 0, t) for p, t in zip(prompts, tables)])
    together = runner.execute([StepItem([7], len(p), t) for p, t in zip(prompts, tables)])
    alone = runner.execute([StepItem([7], len(prompts[1]), tables[1])])
    if cpu_math.row_independent("bf16"):
        assert torch.equal(alone[0], together[1])
    else:    # oneDNN's bf16 kernels on AMX block by the row count (cpu_math's docstring)
        torch.testing.assert_close(alone[0], together[1], rtol=0, atol=0.5)


def test_the_torch_layers_run_where_a_piece_does_not_fit(bf16_model, fp32_model, monkeypatch):
    assert fp32_model.fused_layers is None                           # float32 math: the torch layers
    assert fused_cpu_layer.build(bf16_model, bf16_model.fused_cpu_form) is not None
    monkeypatch.setenv(fused_cpu_layer.ENV, "0")
    assert fused_cpu_layer.build(bf16_model, bf16_model.fused_cpu_form) is None
    monkeypatch.delenv(fused_cpu_layer.ENV)
    layer = bf16_model.layers[0]
    monkeypatch.setattr(layer.self_attn, "window", 64)               # a sliding-window layer
    assert fused_cpu_layer.build(bf16_model, bf16_model.fused_cpu_form) is None
    monkeypatch.undo()
    # another attention backend (the torch path): the torch layers, whatever the model holds
    runner = ModelRunner(bf16_model, num_kv_blocks=8, block_size=16, cpu_kernel=False)
    assert runner.attention.name != fused_cpu_layer.BACKEND
    item = [StepItem([5, 6, 7, 8], 0, [0, 1])]
    with_fused = runner.execute(item)
    saved, bf16_model.fused_layers = bf16_model.fused_layers, None
    try:
        assert torch.equal(runner.execute(item), with_fused)
    finally:
        bf16_model.fused_layers = saved


@pytest.mark.parametrize("math,kernel", [pytest.param("bf16", "dense", marks=needs_bf16),
                                         pytest.param("bf16", "w4a8", marks=[needs_bf16, needs_w4a8]),
                                         pytest.param("float32", "w4a8", marks=needs_w4a8)])
def test_an_int4_model_runs_the_fused_layers_too(default_model_path, fp32_model, math, kernel):
    """The INT4 default (GGUF Q4 import) on the bf16 math (quant/int4_linear.py: tinygemm for steps
    of up to 8 rows, the kept dense bf16 weight above), or on the W4A8 kernel on either math: its
    projections compute bfloat16 in and out, so the layers fuse; same schedule, the same logits as
    its torch layers up to where the two round (the fused form rounds each projection's output to
    bfloat16): KL 1.8e-3 (bf16, dense), as the dense model's two forms differ (2.0e-3 on this
    schedule). On the W4A8 kernel a bfloat16 rounding of a projection's input moves some int8
    activations by a step, which random tokens amplify (KL ~0.06 between the two forms), so there
    both forms run chat prompts and are judged against the float32 model: the fused one drifts about
    as much as the torch layers on the same kernel (bench.quality's prompts: KL 0.020 against 0.018;
    here, 8 chats of 12 answer tokens, on an AVX2 EPYC: 0.024 against 0.021, and 0.020 against 0.024
    with the attention kernel's plain C loops: the same tiny rounding differences swing a 4-chat
    sample's ratio from 0.9 to 1.6, so it takes 8)."""
    from nightshift.engine.loader import load_model
    from nightshift.engine.quant.config import resolve_quant_config
    model = load_model(default_model_path, dtype=torch.float32, cpu_math=math, quant_config=resolve_quant_config("int4"),
                       cpu_int4=kernel)
    assert model.fused_layers is not None and model.kv_dtype == torch.bfloat16
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 23, 71, 9)]
    forced = [torch.randint(100, 40000, (6,), generator=g).tolist() for _ in prompts]
    runner = ModelRunner(model, num_kv_blocks=40, block_size=16)
    fused = schedule(runner, model.fused_layers, prompts, forced)
    torch_layers = schedule(runner, None, prompts, forced)
    if kernel == "w4a8":
        from nightshift.engine.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(default_model_path)
        chats = [("What is the capital of France?", "The capital of France is Paris, a city on the Seine."),
                 ("Name three primary colors.", "The three primary colors of paint are red, yellow and blue."),
                 ("Write a haiku about the sea.", "Waves fold into foam, the tide keeps its quiet time."),
                 ("Why is the sky blue?", "Sunlight scatters off the air, and blue light scatters most."),
                 ("How do bees make honey?", "Bees gather nectar, store it in wax cells and fan it until it thickens."),
                 ("What is a prime number?", "A prime number has exactly two divisors: one and itself, like 7 or 13."),
                 ("Give me a tip for sleeping better.", "Keep the same bedtime every night and dim the lights an hour before."),
                 ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet around the year 1600, in London.")]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in chats]
        forced = [tokenizer.encode(a)[:12] for _, a in chats]
        runner = ModelRunner(model, num_kv_blocks=8 * len(chats), block_size=16)
        fused = schedule(runner, model.fused_layers, prompts, forced)
        torch_layers = schedule(runner, None, prompts, forced)
        reference = schedule(ModelRunner(fp32_model, num_kv_blocks=8 * len(chats), block_size=16), None, prompts,
                             forced)
        assert kl(fused, reference) < 1.25 * kl(torch_layers, reference)
    else:
        assert kl(fused, torch_layers) < 4e-3, kl(fused, torch_layers)
        # the same top-1 wherever the torch layers' leads by more than 0.25 (two bfloat16 steps at
        # these logits, ~20-30: both forms round the LM head's output to bfloat16). Only near-ties
        # may flip: on a 2-core AMX Xeon 2 of 29 rows did (leads of 0.125 and 0), which a share of
        # 95% equal, the rule before, did not allow
        top2 = torch_layers.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.25
        assert clear.sum() >= 10          # random tokens: about half the rows lead clearly (15 of 29)
        assert torch.equal(fused.argmax(-1)[clear], torch_layers.argmax(-1)[clear])
    alone = runner.execute([StepItem([7], len(prompts[1]), list(range(8, 16)))])   # 1 row (dense: tinygemm)
    assert torch.isfinite(alone).all()

"""Calibration activations for the activation-aware quantizers (AWQ scaling, GPTQ).

The full-precision model reads ``CALIBRATION_TEXTS`` as chat turns and continues each greedily
for ``CONTINUATION_TOKENS`` tokens (its own answers: the distribution a chat model is then used
on, none of them from engine/quality.py's evaluation prompts); the prompts plus continuations
are then run once more while every dense linear (not the lm_head) records its inputs:

* ``mean_abs`` [K]: mean |x| per input channel (AWQ's saliency);
* ``sample`` [R, K]: up to ``max_rows`` of the input rows (AWQ's error measure);
* ``xtx`` [K, K] and ``rows``: the sum of x^T x over all rows (GPTQ's Hessian ``2 X^T X``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CALIBRATION_TEXTS = (
    "The history of science is full of surprising discoveries, accidents and long arguments.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Dear customer, thank you for your order. Your package will arrive next week by courier.",
    "In 1492 Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough and let it rise for hours.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates.",
    "How do I reverse a linked list in Java? Please show the code.",
    "Describe the water cycle and why it matters for farmers.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Why is the sky blue during the day and red at sunset?",
    "List five tips for writing a clear and persuasive essay.",
    "What is the difference between a virus and a bacterium?",
    "Solve for x: 3x + 7 = 22, and explain each step.",
    "Tell me a short story about a robot who wants to become a gardener.",
    "What are the main causes of inflation, in simple terms?",
)
CONTINUATION_TOKENS = 96


@dataclass
class ActivationStats:
    mean_abs: torch.Tensor            # [K] float32, mean |x| per input channel
    sample: torch.Tensor              # [R, K] float32, a subsample of calibration rows
    xtx: torch.Tensor | None = None   # [K, K] float64, sum over all rows of x^T x
    rows: int = 0                     # rows summed in xtx


def collect_activation_stats(model, run_calibration, max_rows: int = 512) -> dict[str, ActivationStats]:
    """Hooks every dense linear of ``model`` (names as in WeightSource: "model." + module path),
    calls ``run_calibration()`` and returns per-layer input statistics."""
    sums: dict[str, torch.Tensor] = {}
    xtx: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    samples: dict[str, list[torch.Tensor]] = {}
    hooks = []
    generator = torch.Generator().manual_seed(0)

    def hook_for(name):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.abs().sum(0)
            xd = x.double()
            xtx[name] = xtx.get(name, 0) + xd.t() @ xd
            counts[name] = counts.get(name, 0) + x.shape[0]
            keep = torch.randperm(x.shape[0], generator=generator)[:max_rows]
            samples.setdefault(name, []).append(x[keep])
        return hook

    for path, module in model.named_modules():
        if type(module).__name__ == "DenseLinear" and path != "lm_head":
            hooks.append(module.register_forward_pre_hook(hook_for(f"model.{path}")))
    try:
        run_calibration()
    finally:
        for h in hooks:
            h.remove()
    stats = {}
    for name, total in sums.items():
        rows = torch.cat(samples[name])
        rows = rows[torch.randperm(rows.shape[0], generator=generator)[:max_rows]]
        stats[name] = ActivationStats(total / counts[name], rows, xtx[name], counts[name])
    return stats


def calibration_sequences(fp_model, tokenizer, continuation_tokens: int = CONTINUATION_TOKENS) -> list[list[int]]:
    """Each calibration text as a chat turn followed by the model's greedy answer."""
    from nightshift.engine.model_runner import StepItem

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in CALIBRATION_TEXTS]
    runner, tables = _runner_for(fp_model, [len(p) + continuation_tokens for p in prompts])
    sequences = [list(p) for p in prompts]
    items = [StepItem(p, 0, t) for p, t in zip(prompts, tables)]
    with torch.no_grad():
        for _ in range(continuation_tokens):
            chosen = runner.execute(items).argmax(-1).tolist()
            for seq, tok in zip(sequences, chosen):
                seq.append(tok)
            items = [StepItem([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
    return sequences


def calibration_stats(fp_model, tokenizer) -> dict[str, ActivationStats]:
    """Activation statistics of ``fp_model`` (dense layers) over the calibration sequences."""
    from nightshift.engine.model_runner import StepItem

    sequences = calibration_sequences(fp_model, tokenizer)
    runner, tables = _runner_for(fp_model, [len(s) for s in sequences])
    items = [StepItem(s, 0, t) for s, t in zip(sequences, tables)]
    with torch.no_grad():
        return collect_activation_stats(fp_model, lambda: runner.execute(items))


def _runner_for(fp_model, lengths: list[int], block_size: int = 16):
    """A ModelRunner with room for sequences of `lengths` tokens, and each one's block table."""
    from nightshift.engine.model_runner import ModelRunner

    blocks = [math.ceil(n / block_size) for n in lengths]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    runner = ModelRunner(fp_model, num_kv_blocks=sum(blocks), block_size=block_size)
    return runner, [list(range(s, s + n)) for s, n in zip(starts, blocks)]


def checkpoint_calibrator(checkpoint, model: str, cache_dir=None):
    """The loader's ``calibrate`` callback: builds the float32 model and measures it."""
    def calibrate() -> dict[str, ActivationStats]:
        from nightshift.engine.models import build_model
        from nightshift.engine.tokenizer import load_tokenizer
        fp_model = build_model(checkpoint, dtype=torch.float32, device="cpu", quant_config=None)
        return calibration_stats(fp_model, load_tokenizer(model, cache_dir=cache_dir))
    return calibrate

"""Activation-aware per-input-channel scaling (AWQ-style) for round-to-nearest INT4.

Channels that carry large activations matter more; scaling the weight's column ``k`` up by
``s_k`` before quantizing (and the activation down by ``1/s_k`` at run time) gives them a finer
effective grid. ``s = mean|x|^alpha`` (normalised), with ``alpha`` in 0.0 .. 1.0 chosen per
layer by the smallest output error on calibration activations (alpha = 0 is plain RTN, so the
search never does worse on the calibration rows than RTN).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.format import Int4Weight, quantize_rtn

ALPHAS = tuple(i / 10 for i in range(11))


@dataclass
class ActivationStats:
    mean_abs: torch.Tensor   # [K] float32, mean |x| per input channel
    sample: torch.Tensor     # [R, K] float32, a subsample of calibration rows


def collect_activation_stats(model, run_calibration, max_rows: int = 512) -> dict[str, ActivationStats]:
    """Hooks every dense linear of ``model`` (names as in WeightSource: "model." + module path),
    calls ``run_calibration()`` and returns per-layer input statistics."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    samples: dict[str, list[torch.Tensor]] = {}
    hooks = []
    generator = torch.Generator().manual_seed(0)

    def hook_for(name):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.abs().sum(0)
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
        stats[name] = ActivationStats(total / counts[name], rows)
    return stats


def quantize_awq(weight: torch.Tensor, stats: ActivationStats, group_size: int) -> tuple[Int4Weight, torch.Tensor, float]:
    """(INT4 weight of ``W * s``, the activation multiplier ``1/s`` [K], the chosen alpha)."""
    w = weight.to(torch.float32)
    x = stats.sample
    reference = x @ w.t()
    mean_abs = stats.mean_abs.clamp(min=1e-6)
    best = None
    for alpha in ALPHAS:
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        q = quantize_rtn(w * s, group_size, clip_search=False)
        err = ((x / s) @ q.dequantize().t() - reference).pow(2).mean().item()
        if best is None or err < best[0]:
            best = (err, alpha, s)
    _, alpha, s = best
    return quantize_rtn(w * s, group_size), (1.0 / s).to(torch.float32), alpha


CALIBRATION_TEXTS = (
    "The history of science is full of surprising discoveries, accidents and long arguments.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Dear customer, thank you for your order. Your package will arrive next week by courier.",
    "In 1492 Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough and let it rise for hours.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates.",
)


def calibration_stats(fp_model, tokenizer) -> dict[str, ActivationStats]:
    """Activation statistics of ``fp_model`` (dense layers) over CALIBRATION_TEXTS as chat turns."""
    import math

    from engine.model_runner import ModelRunner, StepItem

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in CALIBRATION_TEXTS]
    block_size = 16
    blocks = [math.ceil(len(t) / block_size) for t in texts]
    runner = ModelRunner(fp_model, num_kv_blocks=sum(blocks), block_size=block_size)
    starts = [sum(blocks[:i]) for i in range(len(texts))]
    items = [StepItem(t, 0, list(range(s, s + n))) for t, s, n in zip(texts, starts, blocks)]
    return collect_activation_stats(fp_model, lambda: runner.execute(items))


def checkpoint_calibrator(checkpoint, model: str, cache_dir=None):
    """The loader's ``calibrate`` callback: builds the float32 model and measures it."""
    def calibrate() -> dict[str, ActivationStats]:
        from engine.models import build_model
        from engine.tokenizer import load_tokenizer
        fp_model = build_model(checkpoint, dtype=torch.float32, device="cpu", quant_config=None)
        return calibration_stats(fp_model, load_tokenizer(model, cache_dir=cache_dir))
    return calibrate

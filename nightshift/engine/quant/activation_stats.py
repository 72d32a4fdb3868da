"""Per-layer input statistics of the dense linears, what the activation-aware quantizers read:

* ``mean_abs`` [K]: mean |x| per input channel (AWQ's saliency, engine/quant/awq.py);
* ``sample`` [R, K]: up to ``max_rows`` of the input rows (AWQ's error measure);
* ``xtx`` [K, K] and ``rows``: the sum of x^T x over all rows (GPTQ's Hessian ``2 X^T X``,
  engine/quant/gptq.py).

What the model runs while they are recorded: engine/quant/calibration.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nightshift.engine.layers.linear import DenseLinear


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
        if isinstance(module, DenseLinear) and path != "lm_head":
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

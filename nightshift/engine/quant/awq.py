"""Activation-aware per-input-channel scaling (AWQ-style) for round-to-nearest INT4.

Channels that carry large activations matter more; scaling the weight's column ``k`` up by
``s_k`` before quantizing (and the activation down by ``1/s_k`` at run time) gives them a finer
effective grid. ``s = mean|x|^alpha`` (normalised), with ``alpha`` in 0.0 .. 1.0 chosen per
layer by the smallest output error on calibration activations (alpha = 0 is plain RTN, so the
search never does worse on the calibration rows than RTN).
"""
from __future__ import annotations

import torch

from nightshift.engine.quant.activation_stats import ActivationStats
from nightshift.engine.quant.format import Int4Weight, quantize_rtn

ALPHAS = tuple(i / 10 for i in range(11))


def quantize_awq(weight: torch.Tensor, stats: ActivationStats, group_size: int) -> tuple[Int4Weight, torch.Tensor, float]:
    """(INT4 weight of ``W * s``, the activation multiplier ``1/s`` [K], the chosen alpha)."""
    w = weight.to(torch.float32)
    s, alpha = awq_channel_scale(w, stats, group_size)
    return quantize_rtn(w * s, group_size), (1.0 / s).to(torch.float32), alpha


def awq_channel_scale(weight: torch.Tensor, stats: ActivationStats, group_size: int) -> tuple[torch.Tensor, float]:
    """(per-input-channel multiplier ``s`` [K] for the weight, alpha) with the least output error
    of plain RTN of ``W * s`` on the calibration sample."""
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
    return s, alpha

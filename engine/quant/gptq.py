"""GPTQ (Frantar et al. 2022): round the weight one input channel at a time and spread each
channel's rounding error over the channels not yet rounded, weighted by the inverse Hessian of
the layer's output error on calibration activations, ``H = 2 X^T X`` (engine/quant/calibration.py).

Per group of ``group_size`` channels the grid (scale, min) is chosen when the group is reached,
from the weights as updated by the error of the groups before it, by the same search as
``quantize_rtn`` (engine/quant/format.py); within the group every value is then rounded to the
nearest grid point, so the result is in our plain INT4 format (no reordering, no extra tensors).
Columns are processed in their natural order (no act-order), in blocks of one group.
"""
from __future__ import annotations

import torch

from engine.quant.calibration import ActivationStats
from engine.quant.format import Int4Weight, pack_int4, search_group_grid

DAMP = 0.01   # fraction of the mean Hessian diagonal added to it (GPTQ's percdamp)


def quantize_gptq(weight: torch.Tensor, stats: ActivationStats, group_size: int,
                  damp: float = DAMP) -> Int4Weight:
    if stats.xtx is None or stats.rows == 0:
        raise ValueError("GPTQ needs the calibration inputs' x^T x (ActivationStats.xtx)")
    w = weight.detach().to(torch.float64).clone()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    h = 2.0 * stats.xtx.to(torch.float64) / stats.rows
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    # Upper Cholesky factor of H^-1: row i holds how channel i's error moves channels > i.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q_all = torch.empty(n, k, dtype=torch.float32)
    scales, mins = [], []
    for g0 in range(0, k, group_size):
        g1 = g0 + group_size
        block = w[:, g0:g1].clone()
        q, scale, low = search_group_grid(block.to(torch.float32).unsqueeze(1))
        scale, low = scale.squeeze(1), low.squeeze(1)           # [n, 1] float16
        scales.append(scale)
        mins.append(low)
        s32, m32 = scale.to(torch.float64), low.to(torch.float64)
        inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
        errors = torch.empty_like(block)
        hblock = hinv[g0:g1, g0:g1]
        for i in range(group_size):
            col = block[:, i:i + 1]
            qi = torch.round((col - m32) * inv).clamp_(0, 15)
            q_all[:, g0 + i] = qi.squeeze(1).to(torch.float32)
            err = (col - (qi * s32 + m32)) / hblock[i, i]
            block[:, i:] -= err * hblock[i, i:].unsqueeze(0)
            errors[:, i:i + 1] = err
        w[:, g1:] -= errors @ hinv[g0:g1, g1:]
    return Int4Weight(pack_int4(q_all), torch.cat(scales, 1).contiguous(), torch.cat(mins, 1).contiguous(),
                      group_size)

"""GPTQ (Frantar et al. 2022): round the weight one input channel at a time and spread each
channel's rounding error over the channels not yet rounded, weighted by the inverse Hessian of
the layer's output error on calibration activations, ``H = 2 X^T X`` (engine/quant/activation_stats.py).

Each group's grid (scale, min) comes from the same search as ``quantize_rtn``
(engine/quant/format.py), every value is rounded to the nearest point of its group's grid, so
the result is our plain INT4 format (no reordering, no extra tensors).
By default (``act_order``) columns are processed by decreasing Hessian diagonal (the channels
with the largest inputs first) and each group's grid is fixed beforehand from the unmodified
weights ("static groups"), so the stored format still has one grid per group of consecutive
channels. Without it, columns go in their natural order in blocks of one group, and each
group's grid is searched on the weights as updated by the groups before it.
"""
from __future__ import annotations

import torch

from nightshift.engine.quant.activation_stats import ActivationStats
from nightshift.engine.quant.awq import awq_channel_scale
from nightshift.engine.quant.format import Int4Weight, pack_int4, search_group_grid

# Fraction of the mean Hessian diagonal added to it (GPTQ's percdamp). With ~1.5-3k calibration
# rows for up to 1536 inputs the Hessian is poorly determined, so strong damping generalises
# better. Mean relative output error of SmolLM2-135M's layers on activations of six texts
# outside the calibration set (48-token answers): RTN 6.4%; all layers: damp 0.01 5.2%, 0.1
# 4.5%; every third layer: 0.1 4.5%, 0.3 4.4%, 1.0 4.5%, act-order at 0.3 4.2%.
DAMP = 0.3
ACT_ORDER = True


def quantize_gptq(weight: torch.Tensor, stats: ActivationStats, group_size: int,
                  damp: float = DAMP, act_order: bool = ACT_ORDER) -> Int4Weight:
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
    if act_order:
        return _gptq_act_order(w, h, group_size)
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


def _gptq_act_order(w: torch.Tensor, h: torch.Tensor, group_size: int) -> Int4Weight:
    n, k = w.shape
    q0, scales, mins = search_group_grid(w.to(torch.float32).view(n, k // group_size, group_size))
    s_col = scales.to(torch.float64).squeeze(-1).repeat_interleave(group_size, 1)   # [n, k]
    m_col = mins.to(torch.float64).squeeze(-1).repeat_interleave(group_size, 1)
    perm = torch.argsort(torch.diagonal(h), descending=True)
    w, s_col, m_col = w[:, perm], s_col[:, perm], m_col[:, perm]
    h = h[perm][:, perm]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    inv_col = torch.where(s_col > 0, 1.0 / s_col, torch.zeros_like(s_col))
    q = torch.empty(n, k, dtype=torch.float64)
    block = 128
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].clone()
        errors = torch.empty_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            col = wb[:, i]
            qi = torch.round((col - m_col[:, c]) * inv_col[:, c]).clamp_(0, 15)
            q[:, c] = qi
            err = (col - (qi * s_col[:, c] + m_col[:, c])) / hb[i, i]
            wb[:, i:] -= err.unsqueeze(1) * hb[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    q = q[:, torch.argsort(perm)].to(torch.float32)
    return Int4Weight(pack_int4(q), scales.squeeze(-1).contiguous(), mins.squeeze(-1).contiguous(), group_size)


def quantize_awq_gptq(weight: torch.Tensor, stats: ActivationStats, group_size: int) -> tuple[Int4Weight, torch.Tensor]:
    """AWQ's per-channel scaling (engine/quant/awq.py) followed by GPTQ of the scaled weight
    ``W * s`` on the correspondingly scaled inputs ``x / s``; returns (weight, input scale 1/s)."""
    s, _ = awq_channel_scale(weight, stats, group_size)
    inv = (1.0 / s).to(torch.float64)
    scaled = ActivationStats(stats.mean_abs / s, stats.sample / s, stats.xtx * inv[:, None] * inv[None, :], stats.rows)
    return quantize_gptq(weight.to(torch.float32) * s, scaled, group_size), (1.0 / s).to(torch.float32)

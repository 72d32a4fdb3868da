"""The one INT4 weight format of the engine (see engine/quant/README.md).

A linear weight ``W[N, K]`` (out_features x in_features) is stored as

* ``qweight``: uint8 ``[N, K // 2]``; byte ``j`` of a row holds input channel ``2j`` in its
  low nibble and ``2j + 1`` in its high nibble; values are unsigned 0..15.
* ``scales`` and ``mins``: float16 ``[N, K // group_size]``, one pair per group of
  ``group_size`` consecutive input channels of a row.

and dequantizes as ``w = q * scale + min`` (asymmetric: the minimum is a float, not an
integer zero point). GGUF Q4_1 is exactly this with group 32 (``d``, ``m``); Q4_0 is the
special case ``min = -8 * d``. Everything that runs INT4 (CPU tinygemm, Triton) converts
from this format at load time; this format is what the on-disk cache stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4Weight:
    qweight: torch.Tensor   # uint8 [N, K // 2]
    scales: torch.Tensor    # float16 [N, K // group_size]
    mins: torch.Tensor      # float16 [N, K // group_size]
    group_size: int

    def __post_init__(self) -> None:
        n, half_k = self.qweight.shape
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8, got {self.qweight.dtype}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")
        k = half_k * 2
        if k % self.group_size:
            raise ValueError(f"in_features {k} is not a multiple of group_size {self.group_size}")
        expected = (n, k // self.group_size)
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected}")
            if t.dtype != torch.float16:
                raise ValueError(f"{name} must be float16, got {t.dtype}")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``[N, K]`` weight. Computed in float32 as ``q * scale + min`` (two separate
        roundings, like GGUF's reference dequantizer) and then cast to ``dtype``."""
        q = unpack_int4(self.qweight).to(torch.float32)
        n, k = q.shape
        groups = q.view(n, k // self.group_size, self.group_size)
        w = groups * self.scales.to(torch.float32).unsqueeze(-1)
        w = w + self.mins.to(torch.float32).unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def select_rows(self, index: torch.Tensor) -> "Int4Weight":
        """Rows (output channels) reordered/selected, e.g. to undo GGUF's q/k permutation."""
        return Int4Weight(self.qweight[index].contiguous(), self.scales[index].contiguous(),
                          self.mins[index].contiguous(), self.group_size)

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.mins.to(device),
                          self.group_size)

    @staticmethod
    def cat_rows(parts: list["Int4Weight"]) -> "Int4Weight":
        """Stack several weights with the same input size along the output dim (fused qkv)."""
        group_sizes = {p.group_size for p in parts}
        if len(group_sizes) != 1:
            raise ValueError(f"cannot fuse INT4 weights with different group sizes {sorted(group_sizes)}")
        return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.mins for p in parts]), parts[0].group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integer values 0..15, ``[N, K]`` (K even) -> uint8 ``[N, K // 2]``."""
    if q.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack two values per byte, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> uint8 values 0..15, ``[N, K]``."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def fitting_group_size(in_features: int, requested: int) -> int:
    """The requested group if it divides the row, else the largest supported one below it that
    does (SmolLM2's 576-wide rows take 64 when 128 is asked for)."""
    for group in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if group <= requested and in_features % group == 0:
            return group
    raise ValueError(f"in_features {in_features} is not a multiple of any supported group size "
                     f"<= {requested} ({SUPPORTED_GROUP_SIZES})")


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, clip_search: bool = True) -> Int4Weight:
    """Round-to-nearest asymmetric INT4 of a dense ``[N, K]`` weight, one (scale, min) per group.

    Every integer is the nearest grid point of its weight; what the search chooses is each
    group's grid (scale, min), by the smallest squared error of the group (clip_search):

    1. the range [min, max] of the group shrunk by one ratio in ``CLIP_RATIOS`` (1.0 .. 0.70);
    2. then the lower and the upper end shrunk separately (asymmetric clipping), each over the
       same ratios with the other end kept;
    3. then ``REFIT_STEPS`` alternating steps: least-squares (scale, min) for the current
       integers, integers re-rounded to the new grid (HQQ/k-quant style).

    A step only replaces a group's grid when it lowers that group's error, so the result is
    never worse per group than the plain [min, max] grid (``clip_search=False``). The scale and
    min are rounded to float16 before the integers are chosen, so the stored triple reproduces
    the weight as closely as the format allows.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    q, scales, mins = search_group_grid(w, clip_search)
    return Int4Weight(pack_int4(q.reshape(n, k)), scales.squeeze(-1).contiguous(),
                      mins.squeeze(-1).contiguous(), group_size)


CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.00, 0.98 ... 0.70
REFIT_STEPS = 3


def search_group_grid(w: torch.Tensor, clip_search: bool = True):
    """Per group (last dim of ``w [..., G]``): (integers, float16 scale, float16 min), each
    ``[..., 1]`` but the integers, chosen as described in ``quantize_rtn``."""
    wmin = w.amin(dim=-1, keepdim=True)
    wmax = w.amax(dim=-1, keepdim=True)
    best = _Candidate(w, wmin, wmax)
    if not clip_search:
        return best.q, best.scales, best.mins
    for ratio in CLIP_RATIOS[1:]:
        best.keep_better(_Candidate(w, wmin * ratio, wmax * ratio))
    lo, hi = best.mins.float(), best.mins.float() + 15 * best.scales.float()
    for ratio in CLIP_RATIOS[1:]:
        best.keep_better(_Candidate(w, wmin * ratio, hi))
    lo = best.mins.float()
    for ratio in CLIP_RATIOS[1:]:
        best.keep_better(_Candidate(w, lo, wmax * ratio))
    for _ in range(REFIT_STEPS):
        scale, low = _least_squares_grid(w, best.q)
        best.keep_better(_Candidate(w, low, low + 15 * scale))
    return best.q, best.scales, best.mins


class _Candidate:
    """A grid [lo, hi] per group, its integers and squared error (float16 scale/min)."""

    def __init__(self, w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
        self.q, self.scales, self.mins = _round_group(w, lo, hi)
        self.err = (self.q * self.scales.float() + self.mins.float() - w).pow_(2).sum(-1, keepdim=True)

    def keep_better(self, other: "_Candidate") -> None:
        better = other.err < self.err
        self.err = torch.where(better, other.err, self.err)
        self.q = torch.where(better, other.q, self.q)
        self.scales = torch.where(better, other.scales, self.scales)
        self.mins = torch.where(better, other.mins, self.mins)


def _least_squares_grid(w: torch.Tensor, q: torch.Tensor):
    """(scale, min) minimising sum (q * scale + min - w)^2 per group for fixed integers q."""
    q_mean = q.mean(-1, keepdim=True)
    w_mean = w.mean(-1, keepdim=True)
    dq = q - q_mean
    var = dq.pow(2).sum(-1, keepdim=True)
    scale = torch.where(var > 0, (dq * (w - w_mean)).sum(-1, keepdim=True) / var.clamp(min=1e-12),
                        torch.zeros_like(var)).clamp(min=0)
    return scale, w_mean - scale * q_mean


def _round_group(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    scales = ((hi - lo) / 15).clamp(min=0).to(torch.float16)
    mins = lo.to(torch.float16)
    s32 = scales.to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    q = torch.round((w - mins.to(torch.float32)) * inv).clamp_(0, 15)
    return q, scales, mins

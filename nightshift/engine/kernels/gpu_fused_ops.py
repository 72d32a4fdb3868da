"""Triton kernels for the small ops of a decoder layer on the GPU (engine/models/fused_gpu_layer.py).

At batch 1 an 8B decode step on an H200 spent ~1 ms of its ~3.7 ms of GPU time in ~17 small torch
kernels per layer (the RMSNorm's casts and scale, the residual adds, RoPE's negation, concatenation,
products and sum, SiLU and the product with up), each ~1-2 us. These three kernels do the same work
in three launches per layer, and round to the activation dtype where the torch ops do: under
Triton's interpreter RoPE gives torch's bits and RMSNorm and SiLU differ only by float32 summation
order and the last bit of exp; compiled on an H200 (Triton 3.6) RoPE differed from torch by one
unit in the last place in about a quarter of the entries, in fp16, bf16 and float32 alike (the
cause, a fused multiply-add or a dropped intermediate rounding in the compiled code, is not pinned
down), and the model's logits match the torch layers' (tests/engine/kernels/test_kernel_runner.py):

* ``add_rms_norm(x, delta, weight, eps)``: ``x += delta`` in place (rounded to x's dtype, as
  ``x + delta``), then ``weight * rms_norm(x in float32)`` with the normalised row rounded to the
  dtype before the scale (llama.RMSNorm, as transformers' LlamaRMSNorm). One program per row.
* ``rope_(qk, cos, sin)``: rotates the q and k heads in place (each head's first ``cos.shape[-1]``
  dims; llama.apply_rope): ``x * cos + rotate_half(x) * sin`` with both products rounded before the
  sum. ``qk`` may be a strided view of the fused qkv output. One program per (token, head).
* ``silu_mul(gate_up)``: ``silu(gate) * up`` of the ``[T, 2 I]`` gate/up output, silu rounded first.

Tested against the torch ops under TRITON_INTERPRET=1 on CPU and compiled on CUDA
(tests/engine/kernels/test_gpu_fused_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, out_ptr, H, stride_x, stride_d, stride_o, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(qk_ptr, cos_ptr, sin_ptr, heads, stride_t, stride_h, stride_c,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = pid // heads
    h = pid % heads
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    base = qk_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + d, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_c + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d, mask=mask, other=0.0).to(tl.float32)
    dtype = qk_ptr.dtype.element_ty
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype before the sum (as torch)
    out1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + d, out1, mask=mask)
    tl.store(base + HALF + d, out2, mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + I + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` (in place, when given), then the RMSNorm of x scaled by weight, in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"add_rms_norm takes [T, H] rows with unit column stride, got {tuple(x.shape)}")
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens:
        d = x if delta is None else delta
        _add_rms_norm_kernel[(tokens,)](x, d, weight, out, hidden, x.stride(0), d.stride(0), out.stride(0), eps,
                                        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(hidden),
                                        num_warps=4 if hidden <= 4096 else 8)
    return out


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``qk [T, heads, head_dim]`` (head dim contiguous, any token/head strides) in place by
    the ``[T, 1, rot]`` cos/sin tables; dims past ``rot`` stay as they are. Returns qk."""
    tokens, heads, head_dim = qk.shape
    rot = cos.shape[-1]
    if qk.stride(2) != 1 or rot % 2 or rot > head_dim or cos.shape[0] != tokens:
        raise ValueError(f"rope_: qk {tuple(qk.shape)} with cos {tuple(cos.shape)}")
    cos2, sin2 = cos.reshape(tokens, rot), sin.reshape(tokens, rot)
    if cos2.stride(1) != 1 or sin2.stride() != cos2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    if tokens:
        _rope_kernel[(tokens * heads,)](qk, cos2, sin2, heads, qk.stride(0), qk.stride(1), cos2.stride(0),
                                        HALF=rot // 2, BLOCK=triton.next_power_of_2(rot // 2), num_warps=1)
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[T, 2 I]`` row block whose first half is the gate."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul takes [T, 2 I] rows, got {tuple(gate_up.shape)}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), device=gate_up.device, dtype=gate_up.dtype)
    if tokens:
        block = min(triton.next_power_of_2(inter), 2048)
        _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                              BLOCK=block, num_warps=4)
    return out

"""The fused C kernels of the bf16 CPU layer (engine/kernels/cpu_fused_ops.py) against the torch
ops they replace (llama.py's RMSNorm, apply_rope, index_copy_kv, SiLU-and-mul), computed in
float32 and rounded to bfloat16 at the same places."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.attention.torch_paged import index_copy_kv
from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.models.llama import RMSNorm, apply_rope, rope_table

pytestmark = pytest.mark.skipif(cpu_fused_ops.load() is None, reason="no C compiler: the model keeps its torch layers")


def within_one_bf16_step(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """bfloat16 results equal but where float32 summation order moved a value across a rounding
    boundary: one bfloat16 step (2^-7 relative) at most."""
    assert actual.dtype == expected.dtype == torch.bfloat16
    a, e = actual.float(), expected.float()
    return bool(((a - e).abs() <= e.abs() * 2 ** -7 + 1e-6).all()) and (a == e).float().mean().item() > 0.95


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_adds_the_residual_in_place_and_normalises_to_bf16(with_delta):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g) * 3
    delta = (torch.randn(37, 576, generator=g)).to(torch.bfloat16) if with_delta else None
    weight = torch.rand(576, generator=g) + 0.5
    expected_x = x + delta.float() if with_delta else x.clone()
    expected = (weight * F.rms_norm(expected_x, (576,), eps=1e-5)).to(torch.bfloat16)
    out = cpu_fused_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_x)               # the residual stream, exactly
    assert within_one_bf16_step(out, expected)


def test_add_rms_norm_with_a_post_norm_on_the_delta_and_without_an_output():
    """Gemma's sandwich norm: x += post_w * rms_norm(delta), then (optionally) the next pre-norm."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 128, generator=g) * 3
    delta = (torch.randn(9, 128, generator=g) * 7).to(torch.bfloat16)
    post, pre = torch.rand(128, generator=g) + 0.5, torch.rand(128, generator=g) + 0.5
    expected_x = x + post * F.rms_norm(delta.float(), (128,), eps=1e-6)
    y = x.clone()
    out = cpu_fused_ops.add_rms_norm(y, delta, pre, 1e-6, delta_weight=post)
    torch.testing.assert_close(y, expected_x, rtol=1e-6, atol=1e-5)
    assert within_one_bf16_step(out, (pre * F.rms_norm(y, (128,), eps=1e-6)).to(torch.bfloat16))
    z = x.clone()
    assert cpu_fused_ops.add_rms_norm(z, delta, None, 1e-6, delta_weight=post) is None
    assert torch.equal(z, y)


def test_gelu_tanh_mul_of_the_gate_and_up_halves():
    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(7, 2 * 640, generator=g) * 3).to(torch.bfloat16)
    gate, up = gate_up.float().split(640, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") * up).to(torch.bfloat16)
    out = cpu_fused_ops.gelu_tanh_mul(gate_up)
    # one bfloat16 step, and near zero (large negative gates: 1 + tanh(..) cancels) 2e-4 absolute
    assert ((out.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7 + 2e-4).all()
    assert (out == expected).float().mean() > 0.95


@pytest.mark.parametrize("width", [1536, 37])     # whole AVX-512 vectors; and a scalar tail
def test_silu_mul_of_the_gate_and_up_halves(width):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(19, 2 * width, generator=g) * 4).to(torch.bfloat16)
    gate, up = gate_up.float().split(width, dim=-1)
    expected = (F.silu(gate) * up).to(torch.bfloat16)
    assert within_one_bf16_step(cpu_fused_ops.silu_mul(gate_up), expected)


def test_silu_mul_at_the_edges_of_float32():
    """Gates far out and not finite, in the vector loop and in the tail: torch's values (its
    NaNs too), a silu that underflows giving zero or torch's tiny value."""
    edges = [float("-inf"), float("inf"), float("nan"), -100.0, 100.0, -88.0, 89.0, 0.0, -1e-30, 3.0]
    gate = torch.tensor((edges * 4)[:37])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1).to(torch.bfloat16)
    expected = (F.silu(gate_up.float()[:, :37]) * 1.5).to(torch.bfloat16)
    out = cpu_fused_ops.silu_mul(gate_up)
    assert torch.equal(out.isnan(), expected.isnan())
    close = (out.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7 + 1e-30
    assert ((out == expected) | close | expected.isnan()).all()      # == for the infinities


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary, with_bias, qk_norm, clip", [(64, False, None, None), (64, True, None, None),
                                                            (32, False, None, None), (64, False, "head", None),
                                                            (64, False, "whole", None), (64, False, "whole", 1.5)])
def test_rope_store_rotates_q_and_k_and_writes_k_v_into_the_pool(rotary, with_bias, qk_norm, clip, kv_dtype):
    """Full and partial rotary (Phi-3's), a q/k/v bias (Qwen2's), per-head q/k RMSNorms before RoPE
    (Qwen3's), RMSNorms over the whole q and k projections and q/k/v clamped after them (OLMoE's
    norms and clip_qkv), the rows' slots scattered; a float32 pool or a bfloat16 one."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens, block_size = 9, 3, 64, 11, 16
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    bias = torch.randn(width, generator=g) if with_bias else None
    positions = torch.randint(0, 500, (tokens,), generator=g)
    cos, sin = rope_table(positions, 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary)))
    slots = torch.randperm(8 * block_size, generator=g)[:tokens]
    k_cache = torch.zeros(8, block_size, kv_heads, dim, dtype=kv_dtype)
    v_cache = torch.zeros(8, block_size, kv_heads, dim, dtype=kv_dtype)

    full = qkv.float() + (bias if with_bias else 0)
    qk = full[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v_ref = full[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    norms = None
    if qk_norm == "head":
        norms = (1 + 0.3 * torch.randn(dim, generator=g), 1 + 0.3 * torch.randn(dim, generator=g), 1e-6)
        q_part, k_part = qk.split([heads, kv_heads], dim=1)
        qk = torch.cat((RMSNorm(norms[0], 1e-6)(q_part), RMSNorm(norms[1], 1e-6)(k_part)), dim=1)
    elif qk_norm == "whole":
        norms = (1 + 0.3 * torch.randn(heads * dim, generator=g), 1 + 0.3 * torch.randn(kv_heads * dim, generator=g),
                 1e-6)
        q_part, k_part = qk.reshape(tokens, -1).split([heads * dim, kv_heads * dim], dim=1)
        qk = torch.cat((RMSNorm(norms[0], 1e-6)(q_part), RMSNorm(norms[1], 1e-6)(k_part)), dim=1)
        qk = qk.view(tokens, heads + kv_heads, dim)
    if clip is not None:
        assert (qk.abs() > clip).any() and (v_ref.abs() > clip).any()      # the clamp bites
        qk, v_ref = qk.clamp(-clip, clip), v_ref.clamp(-clip, clip)
    qk = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    q_ref, k_ref = qk.split([heads, kv_heads], dim=1)
    k_expected, v_expected = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    index_copy_kv(k_expected, v_expected, k_ref, v_ref, slots)

    q = cpu_fused_ops.rope_store(qkv, bias, cos.unsqueeze(1), sin.unsqueeze(1), slots, k_cache, v_cache, heads, norms,
                                 clip=clip)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-5)
    if kv_dtype == torch.float32:
        torch.testing.assert_close(k_cache, k_expected, rtol=1e-6, atol=1e-5)
    else:   # rounded to bfloat16 from float32 values within 1e-5 of the reference's
        assert within_one_bf16_step(k_cache.flatten(), k_expected.flatten())
    assert torch.equal(v_cache, v_expected)


def test_moe_combine_adds_each_tokens_weighted_experts_to_the_stream():
    """The experts' bfloat16 outputs in their sorted order, each token's k of them weighted by the
    router and added to the float32 residual stream: as the torch layer's index_add (to float32
    summation order)."""
    g = torch.Generator().manual_seed(5)
    tokens, hidden, k, experts = 13, 96, 3, 5
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    order = torch.argsort(chosen.reshape(-1), stable=True)
    out = torch.randn(tokens * k, hidden, generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, k, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    expected = x + torch.zeros(tokens, hidden).index_add_(
        0, order // k, out.float() * weights.reshape(-1, 1).index_select(0, order))
    got = cpu_fused_ops.moe_combine(x.clone(), out, order, weights)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)

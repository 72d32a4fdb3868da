"""The GPU layer's small-op kernels (engine/kernels/gpu_fused_ops.py) against the torch ops they
replace (llama.RMSNorm, llama.apply_rope, F.silu(gate) * up): under Triton's interpreter on CPU
(float32, float16), compiled on CUDA with bfloat16 too."""
import pytest
import torch
import torch.nn.functional as F

from tests.engine.kernels.kernel_cases import kernel_dtypes, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from nightshift.engine.kernels import gpu_fused_ops  # noqa: E402
from nightshift.engine.models.llama import RMSNorm, apply_rope  # noqa: E402


def _close(a, b, dtype):
    """Equal to float32 rounding, and in 16-bit dtypes the same bits but for a few entries (float32
    summation order inside the norm, the last bit of exp)."""
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert torch.allclose(a.float(), b.float(), rtol=ulp, atol=ulp), (a - b).abs().max()
    if dtype != torch.float32:
        assert (a != b).float().mean() < 0.01


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_is_the_residual_add_and_the_torch_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    norm = RMSNorm(weight, 1e-5)
    _close(gpu_fused_ops.add_rms_norm(x.clone(), None, weight, 1e-5), norm(x), dtype)
    summed = x + delta
    residual = x.clone()
    out = gpu_fused_ops.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, summed)                      # x += delta in place, rounded as torch rounds
    _close(out, norm(summed), dtype)
    assert gpu_fused_ops.add_rms_norm(x[:0], None, weight, 1e-5).shape == (0, hidden)


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (32, 16), (24, 24)])
def test_rope_in_place_on_a_strided_qkv_view_is_apply_rope(dtype, head_dim, rot):
    g = torch.Generator().manual_seed(head_dim + rot)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 7, 30, 31])
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype).unsqueeze(1), emb.sin().to(DEVICE, dtype).unsqueeze(1)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    expected = apply_rope(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    out = gpu_fused_ops.rope_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    if DEVICE == "cpu":
        assert torch.equal(qk, expected)                       # same roundings as torch: the same bits
    else:   # compiled (H200, Triton 3.6): one unit in the last place in ~1/4 of the entries
        ulp = torch.finfo(dtype).eps * expected.float().abs() + torch.finfo(dtype).tiny
        assert ((qk.float() - expected.float()).abs() <= ulp).all()
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)   # v untouched


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize("inter", [64, 200, 3000])
def test_silu_mul_is_silu_of_gate_times_up(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _close(gpu_fused_ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="add_rms_norm"):
        gpu_fused_ops.add_rms_norm(x.t(), None, torch.ones(2, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        gpu_fused_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="rope_"):
        gpu_fused_ops.rope_(torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(2, 1, 10, device=DEVICE),
                            torch.zeros(2, 1, 10, device=DEVICE))

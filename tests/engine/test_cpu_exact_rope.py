"""The float32 torch layer's fused RoPE + K/V store (engine/kernels/cpu_exact_rope.py): the same bits
as the torch ops it replaces (llama.apply_rope, then index_copy_kv), kernel and whole model."""
from __future__ import annotations

import pytest
import torch

from bench.runner import decode_items
from nightshift.engine.attention import CpuKernelAttention
from nightshift.engine.attention.torch_paged import index_copy_kv
from nightshift.engine.kernels import cpu_exact_rope
from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.models.llama import apply_rope, rope_table
from nightshift.engine.step import StepItem

pytestmark = pytest.mark.skipif(cpu_exact_rope.load() is None, reason="no C compiler here: the torch ops run")


@pytest.mark.parametrize("heads, kv_heads, dim, rotary, layout", [
    (9, 3, 64, 64, "projection view"),     # the default model's shape: q/k and v views of one q/k/v output
    (8, 2, 128, 128, "contiguous"),        # q/k made anew (Qwen3's q/k norms, torch.cat)
    (6, 2, 96, 32, "projection view"),     # partial rotary (Phi-3's): the rest of each head copied
])
def test_rope_store_gives_the_torch_ops_bits(heads, kv_heads, dim, rotary, layout):
    g = torch.Generator().manual_seed(dim)
    rows, blocks, block_size = 37, 16, 8
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 4
    qk_flat, v_flat = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk, v = qk_flat.view(rows, heads + kv_heads, dim), v_flat.view(rows, kv_heads, dim)
    if layout == "contiguous":
        qk = qk.contiguous()
    positions = torch.randint(0, 4000, (rows,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos, sin = (t.unsqueeze(1) for t in rope_table(positions, inv_freq))
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q_expected, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)
    index_copy_kv(k_expected, v_expected, k, v, slots)

    assert cpu_exact_rope.fits(qk, v, cos, k_cache, v_cache)
    q = cpu_exact_rope.rope_store(qk, v, cos, sin, slots, k_cache, v_cache, heads)
    assert q.is_contiguous() and q.shape == (rows, heads, dim)
    assert torch.equal(q, q_expected)
    assert torch.equal(k_cache, k_expected)          # every other slot untouched, too
    assert torch.equal(v_cache, v_expected)


def test_other_dtypes_and_layouts_do_not_fit():
    qk, v = torch.randn(4, 5, 64), torch.randn(4, 1, 64)
    cos, pool = torch.randn(4, 1, 64), torch.zeros(2, 16, 1, 64)
    assert cpu_exact_rope.fits(qk, v, cos, pool, pool)
    assert not cpu_exact_rope.fits(qk, v, cos, pool.bfloat16(), pool.bfloat16())      # the fused bf16 layers' pool
    assert not cpu_exact_rope.fits(qk.bfloat16(), v.bfloat16(), cos, pool, pool)
    assert not cpu_exact_rope.fits(qk.transpose(0, 1), v, cos, pool, pool)             # heads not contiguous


@pytest.mark.slow
@torch.inference_mode()
def test_a_float32_model_gives_the_same_logits_and_pool_as_with_the_torch_ops(monkeypatch):
    """The default model on the float32 CPU math through the CPU kernel backend: a prefill chunk
    over a cached prefix, then a decode step of mixed lengths, with the fused pass and with the
    torch ops (the backend's rope_store switched off): logits and K/V pools bit for bit."""
    model = load_model("default", dtype=torch.float32, cpu_math="float32")
    items, blocks = decode_items(24, 40, 90, 2, 16)
    prefill = StepItem(list(range(1000, 1040)), 32, list(range(blocks, blocks + 5)), True)

    def run():
        runner = ModelRunner(model, blocks + 6, 16)
        assert isinstance(runner.attention, CpuKernelAttention) and runner.kv_dtype == torch.float32
        first = runner.execute([prefill])
        return first, runner.execute(items), runner.kv_caches

    fused = run()
    calls = []
    monkeypatch.setattr(CpuKernelAttention, "rope_store", lambda self, *args: calls.append(1))
    torch_ops = run()
    assert len(calls) == 2 * model.config.num_layers          # the torch ops ran every layer
    assert torch.equal(fused[0], torch_ops[0]) and torch.equal(fused[1], torch_ops[1])
    for (k, v), (k_ref, v_ref) in zip(fused[2], torch_ops[2]):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)

"""The CPU paged-attention kernel (engine/kernels/cpu_paged_attention.py) against plain softmax attention."""
from __future__ import annotations

import random

import pytest
import torch

from nightshift.engine.kernels import cpu_paged_attention


# float32 ulps on either side of a midpoint between two bfloat16 values: an unnormalized probability
# that close to one may round either way, as the kernel's float32 score sums and exponential differ
# from float64 (a rounding tie; an estimate: float32 sums of 64 products at scores of ~10 are off by
# ~1e-6, which moves a probability by ~1e-6 of itself, ~20-30 float32 ulps)
BF16_TIE_ULPS = 64


def bf16_ties(weights: torch.Tensor) -> torch.Tensor:
    """Per head (the last dim summed over): whether any of `weights` sits within BF16_TIE_ULPS of a
    bfloat16 rounding midpoint as a float32."""
    low = weights.float().view(torch.int32) & 0xFFFF
    return ((low - 0x8000).abs() < BF16_TIE_ULPS).any(dim=-1)


def reference(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, bf16_products=False,
              ties=None):
    """Each row: gather its positions' K/V by block table (the last `window` of them with a
    window), repeat K/V per query head, soft-cap the scores where asked, softmax. bf16_products:
    the roundings of the kernel's bfloat16 dot products (the scaled query and the unnormalized
    probabilities rounded to bfloat16, the sums exact); `ties` (a list) then gets each row's heads
    that hold a rounding tie (``bf16_ties``)."""
    _, block_size, kv_heads, dim = k_cache.shape
    heads = q.shape[1]
    out = []
    for i, length in enumerate(lens.tolist()):
        pos = torch.arange(0 if window is None else max(0, length - window), length)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        if bf16_products:
            scores = torch.einsum("hd,thd->ht", (q[i] * scale).bfloat16().double(), keys.double())
        else:
            scores = torch.einsum("hd,thd->ht", q[i].double(), keys.double()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        total = weights.sum(dim=-1, keepdim=True)
        if bf16_products:
            if ties is not None:
                ties.append(bf16_ties(weights))
            weights = weights.float().bfloat16().double()
        out.append(torch.einsum("ht,thd->hd", weights, values.double()) / total)
    return torch.stack(out).float()


def check_against_reference(out, q, k_cache, v_cache, tables, lens, scale, portable, window=None, softcap=None):
    """Within 1e-4 of exact attention over the pool's values; where the kernel multiplies in
    bfloat16, within 1e-5 of attention with the same roundings (every head but those with a
    probability on a rounding tie, which may round the other way) and within the drift those
    roundings bring (~0.4% of a probability) of exact attention."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    exact = reference(q, k_cache.float(), v_cache.float(), tables, lens, scale, window, softcap)
    if not cpu_paged_attention.bf16_products(heads // kv_heads, dim, portable, k_cache.dtype):
        assert (out - exact).abs().max().item() < 1e-4
        return
    ties = []
    rounded = reference(q, k_cache.float(), v_cache.float(), tables, lens, scale, window, softcap, bf16_products=True,
                        ties=ties)
    clear = ~torch.stack(ties)                                 # [rows, heads] without a rounding tie
    assert clear.float().mean().item() > 0.5, clear.float().mean()
    assert (out - rounded).abs().amax(dim=-1)[clear].max().item() < 1e-5
    assert 1e-5 < (out - exact).abs().max().item() < 3e-2      # the roundings are there, and small


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 128, 16),
                                                             (6, 2, 48, 8), (8, 2, 64, 16)])
def test_kernel_matches_softmax_attention(heads, kv_heads, dim, block_size, portable, kv_dtype):
    """Both builds: the native one (AVX-512 loops where the CPU has them and the head dim is a
    multiple of 16, AVX2 loops where the CPU has those: over a bfloat16 pool query heads three at a time,
    so groups of 3, 1, 8 = 3 + 3 + 2, 2 and 4 = 3 + 1 heads per KV head) and the plain C loops every other CPU runs; pools of float32 and of bfloat16
    K/V (compared with attention over the bfloat16 values)."""
    if cpu_paged_attention.load(heads // kv_heads, dim, portable, kv_dtype) is None:
        pytest.skip("no C compiler here: the runner uses the torch path")
    rng = random.Random(heads)
    num_blocks = 96
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(kv_dtype)
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70, 5]
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):   # rows 0 and 5 share their first block, as prefix-cache hits do
        blocks = -(-n // block_size)
        own = [ids.pop() for _ in range(blocks)]
        if i == 5:
            own[0] = int(tables[0, 0])
        tables[i, :blocks] = torch.tensor(own)
    q = torch.randn(len(lens), heads, dim) * 3   # sharp softmaxes too
    lengths = torch.tensor(lens, dtype=torch.int32)
    out = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lengths, dim ** -0.5, portable)
    assert out.shape == q.shape
    check_against_reference(out, q, k_cache, v_cache, tables, lengths, dim ** -0.5, portable)
    # a row's result is the same bits whatever rows share the call (a lone request = a batched one)
    for i in (0, 3, 5):
        alone = cpu_paged_attention.paged_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1].contiguous(),
                                                    lengths[i:i + 1], dim ** -0.5, portable)
        assert torch.equal(alone[0], out[i])


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("window, softcap", [(5, None), (20, None), (None, 2.0), (7, 1.5)])
def test_sliding_window_and_soft_capping(window, softcap, portable):
    """Gemma's and Mistral's attention: each row sees its last `window` positions only, scores
    soft-capped; the table entries of blocks wholly before a row's window are -1 (given back by the
    block manager) and never read."""
    heads, kv_heads, dim, block_size = 8, 2, 64, 4
    if cpu_paged_attention.load(heads // kv_heads, dim, portable, torch.bfloat16) is None:
        pytest.skip("no C compiler here: the runner uses the torch path")
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(64, block_size, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(64, block_size, kv_heads, dim, generator=g).to(torch.bfloat16)
    lens = torch.tensor([1, 5, 9, 23, 40], dtype=torch.int32)
    tables = torch.arange(5 * 10, dtype=torch.int32).view(5, 10)
    q = torch.randn(5, heads, dim, generator=g) * 3
    reference_tables = tables.clone()
    if window is not None:     # blocks before each row's window given back
        for i, n in enumerate(lens.tolist()):
            tables[i, :max(0, n - window) // block_size] = -1
    out = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, portable,
                                              window=window, softcap=softcap)
    check_against_reference(out, q, k_cache, v_cache, reference_tables, lens, dim ** -0.5, portable, window, softcap)
    with pytest.raises(ValueError, match="positive"):
        cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, 1.0, window=0)


def test_pools_of_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_paged_attention.load(3, 64, kv_dtype=torch.float16)


def test_supports_only_float32_and_its_buffers():
    assert not cpu_paged_attention.supports(torch.bfloat16, 9, 3, 64)
    assert not cpu_paged_attention.supports(torch.float32, cpu_paged_attention.MAX_GROUP + 1, 1, 64)
    assert not cpu_paged_attention.supports(torch.float32, 9, 3, cpu_paged_attention.MAX_HEAD_DIM + 1)


def test_prefetch_plans_are_per_core_and_change_no_bit(monkeypatch):
    """The lines a row asks for ahead of its next row (measured per kind of core) only move data
    into cache: the kernel built with Intel's plan, Zen 5's and the others' gives the same bits."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(64, 16, 3, 64, generator=g).bfloat16()
    v_cache = torch.randn(64, 16, 3, 64, generator=g).bfloat16()
    tables = torch.randperm(64, generator=g).to(torch.int32).view(8, 8).contiguous()
    lens = torch.tensor([128, 1, 17, 100, 64, 33, 127, 90], dtype=torch.int32)
    q = torch.randn(8, 9, 64, generator=g) * 3
    outputs = []
    for vendor, family, plan in (("GenuineIntel", 6, (16, 4, 1)), ("AuthenticAMD", 26, (16, 1, 3)),
                                 ("AuthenticAMD", 25, (4, 1, 1)), ("", 0, (4, 1, 1))):
        monkeypatch.setattr(cpu_paged_attention, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(cpu_paged_attention, "cpu_family", lambda f=family: f)
        assert cpu_paged_attention.prefetch_plan() == plan
        monkeypatch.setattr(cpu_paged_attention, "_libs", {})      # build this vendor's kernel
        if cpu_paged_attention.load(3, 64, kv_dtype=torch.bfloat16) is None:
            pytest.skip("no C compiler here: the runner uses the torch path")
        outputs.append(cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, 0.125))
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])

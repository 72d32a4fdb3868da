"""A step's shared prefix attended on AMX tiles (engine/kernels/cpu_prefix_attention.py), the
paged kernel's merge of the positions after it (cpu_paged_attention.paged_attention_after_prefix),
and the CPU kernel backend's choice of the prefix (attention/cpu_kernel_backend.py): against float64
attention, and on the real default model against the same model without the prefix path."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.attention import cpu_kernel_backend
from nightshift.engine.attention.cpu_kernel_backend import PREFIX_MIN_POSITIONS, PREFIX_MIN_ROWS, shared_prefix
from nightshift.engine.kernels import cpu_paged_attention, cpu_prefix_attention

from test_cpu_attention import bf16_ties
from test_cpu_prefill_attention import shared_prompt_logits

needs_amx = pytest.mark.skipif(not cpu_prefix_attention.supports(8, 2, 64, torch.bfloat16),
                               reason="no AMX bf16 tiles on this CPU: the paged kernel attends the whole context")


def shared_pool(rows: int, heads: int, kv_heads: int, dim: int, block_size: int, prefix: int, extra: int,
                kv_dtype=torch.bfloat16, seed: int = 0):
    """A pool whose rows all start with the same `prefix` blocks (scattered), then own blocks
    holding 1 .. extra more positions each; sharp softmaxes (queries x3)."""
    g = torch.Generator().manual_seed(seed)
    own = -(-extra // block_size)
    num_blocks = prefix + rows * own + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    lens = prefix * block_size + torch.randint(1, extra + 1, (rows,), generator=g, dtype=torch.int32)
    tables = torch.zeros(rows, prefix + own, dtype=torch.int32)
    tables[:, :prefix] = ids[:prefix]
    for i in range(rows):
        tables[i, prefix:] = ids[prefix + i * own: prefix + (i + 1) * own]
    q = torch.randn(rows, heads, dim, generator=g) * 3
    return q, k_cache, v_cache, tables, lens


def prefix_reference(q, k_cache, v_cache, blocks, scale, bf16_products: bool = False, ties=None):
    """float64 softmax attention of every row over the positions of `blocks`: (output, log-sum-exp).
    bf16_products: with the roundings of the prefix kernel's (and the paged kernel's) bfloat16 dot
    products, the scaled query and each probability exp(score - max) rounded to bfloat16, the
    softmax sum exact; `ties` (a list) then gets each row's heads that hold a probability on a
    rounding tie (test_cpu_attention.bf16_ties)."""
    _, _, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    keys = k_cache[blocks.long()].reshape(-1, kv_heads, dim).double().repeat_interleave(group, dim=1)
    values = v_cache[blocks.long()].reshape(-1, kv_heads, dim).double().repeat_interleave(group, dim=1)
    if not bf16_products:
        scores = torch.einsum("nhd,phd->nhp", q.double() * scale, keys)
        return torch.einsum("nhp,phd->nhd", torch.softmax(scores, -1), values), torch.logsumexp(scores, -1)
    scores = torch.einsum("nhd,phd->nhp", (q * scale).bfloat16().double(), keys)
    weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
    if ties is not None:
        ties.append(bf16_ties(weights))
    out = torch.einsum("nhp,phd->nhd", weights.float().bfloat16().double(), values) / weights.sum(-1, keepdim=True)
    return out, torch.logsumexp(scores, -1)


def merge_reference(q, k_cache, v_cache, tables, lens, scale, prefix_blocks, prefix_out, prefix_lse, ties):
    """float64 attention after a prefix given as (output, log-sum-exp), with the roundings of the
    paged kernel's bfloat16 products: the scaled query rounded to bfloat16, each probability
    exp(score - m) rounded to bfloat16, m the largest of the row's scores after the prefix and the
    prefix's log-sum-exp; the softmax sum exact. `ties` (a list) gets each row's heads that hold a
    probability on a rounding tie (test_cpu_attention.bf16_ties)."""
    _, block_size, kv_heads, dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = []
    for i, length in enumerate(lens.tolist()):
        pos = torch.arange(prefix_blocks * block_size, length)
        slots = tables[i].long()[pos // block_size] * block_size + pos % block_size
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(group, dim=1)
        values = v_cache.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,phd->hp", (q[i] * scale).bfloat16().double(), keys)
        m = torch.maximum(scores.max(-1).values, prefix_lse[i])
        weights = torch.exp(scores - m[:, None])
        ties.append(bf16_ties(weights))
        w_prefix = torch.exp(prefix_lse[i] - m)
        acc = w_prefix[:, None] * prefix_out[i] + torch.einsum("hp,phd->hd", weights.float().bfloat16().double(), values)
        out.append(acc / (weights.sum(-1) + w_prefix)[:, None])
    return torch.stack(out).float()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-kv", "bf16-kv"])
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (8, 1, 128, 16), (6, 2, 48, 8)])
def test_the_paged_kernel_merges_a_prefix_attended_elsewhere(heads, kv_heads, dim, block_size, kv_dtype):
    """Positions after the prefix from the pool, the prefix's part given (here exact, float64):
    the same as the paged kernel over the whole context (where it multiplies in bfloat16: the
    same as float64 attention with its roundings), and a prefix that is not whole blocks
    below every row's length is refused."""
    if cpu_paged_attention.load(heads // kv_heads, dim, False, kv_dtype) is None:
        pytest.skip("no C compiler here: the runner uses the torch path")
    q, k_cache, v_cache, tables, lens = shared_pool(7, heads, kv_heads, dim, block_size, 3, 40, kv_dtype)
    scale = dim ** -0.5
    out, lse = prefix_reference(q, k_cache, v_cache, tables[0, :3], scale)
    merged = cpu_paged_attention.paged_attention_after_prefix(q, k_cache, v_cache, tables, lens, scale,
                                                              3 * block_size, out.float(), lse.float())
    whole = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, scale)
    if cpu_paged_attention.bf16_products(heads // kv_heads, dim, False, kv_dtype):
        # bfloat16 products round each probability relative to the running maximum, which the
        # prefix's part moves: the merge is checked against the same roundings in float64, and the
        # whole context within the drift those roundings bring
        ties = []
        expected = merge_reference(q, k_cache, v_cache, tables, lens, scale, 3, out, lse, ties)
        clear = ~torch.stack(ties)                             # heads without a probability on a rounding tie
        assert clear.float().mean().item() > 0.5
        torch.testing.assert_close(merged[clear], expected[clear], rtol=1e-5, atol=1e-5)
        assert (merged - whole).abs().max().item() < 3e-2
    else:
        torch.testing.assert_close(merged, whole, rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="whole blocks"):
        cpu_paged_attention.paged_attention_after_prefix(q, k_cache, v_cache, tables, lens, scale,
                                                         3 * block_size - 1, out.float(), lse.float())
    with pytest.raises(ValueError, match="whole blocks"):      # no position left after it for some row
        cpu_paged_attention.paged_attention_after_prefix(q, k_cache, v_cache, tables, lens, scale,
                                                         int(lens.max()) // block_size * block_size,
                                                         out.float(), lse.float())


@needs_amx
@pytest.mark.parametrize("rows, heads, kv_heads, dim, block_size, prefix", [
    (256, 9, 3, 64, 16, 13),     # the default model's shape on the standard workload
    (37, 8, 2, 128, 16, 3),      # 128-dim heads; rows x heads not a multiple of 16
    (5, 4, 4, 64, 32, 1),        # one block, fewer query vectors than a tile
    (33, 16, 1, 64, 16, 2),      # one KV head of 16 query heads
    (20, 8, 2, 64, 8, 5)])       # blocks of 8: a K tile's 16 positions in two blocks
def test_amx_prefix_attention_rounds_as_the_paged_kernel_does(rows, heads, kv_heads, dim, block_size, prefix):
    """The tiles multiply bfloat16 pairs, the scaled query and the probabilities rounded to bfloat16
    as the paged kernel's bfloat16 products round them: output within 1e-5 of float64 attention
    with those roundings (every head without a probability on a rounding tie), within the drift
    they bring of exact attention; the log-sum-exp of the rounded query's scores within float32's
    own error."""
    q, k_cache, v_cache, tables, _ = shared_pool(rows, heads, kv_heads, dim, block_size, prefix, 20)
    blocks = tables[0, :prefix].contiguous()
    out, lse = cpu_prefix_attention.prefix_attention(q, k_cache, v_cache, blocks, dim ** -0.5)
    ties = []
    rounded_out, rounded_lse = prefix_reference(q, k_cache, v_cache, blocks, dim ** -0.5, True, ties)
    clear = ~ties[0]
    assert clear.float().mean().item() > 0.5
    assert (out.double() - rounded_out).abs().amax(-1)[clear].max() < 1e-5
    assert (lse.double() - rounded_lse).abs().max() < 5e-6 * rounded_lse.abs().max()
    exact_out, _ = prefix_reference(q, k_cache, v_cache, blocks, dim ** -0.5)
    assert 1e-5 < (out.double() - exact_out).abs().max() < 3e-2      # the roundings are there, and small


def test_a_step_s_shared_prefix_is_the_blocks_every_row_starts_with():
    block_size = PREFIX_MIN_POSITIONS // 2
    tables = torch.tensor([[7, 3, 9, 11, 0], [7, 3, 9, 12, 13]] * (PREFIX_MIN_ROWS // 2), dtype=torch.int32)
    lens = torch.tensor([3 * block_size + 5, 4 * block_size + 1] * (PREFIX_MIN_ROWS // 2), dtype=torch.int32)
    assert shared_prefix(tables, lens, block_size).tolist() == [7, 3, 9]
    lens[5] = 3 * block_size     # that row's last position is in block 9: two blocks are before every row's end
    assert shared_prefix(tables, lens, block_size).tolist() == [7, 3]
    lens[5] = 2 * block_size     # one: too short a prefix to be worth the tiles
    assert shared_prefix(tables, lens, block_size) is None
    lens[5] = 3 * block_size
    tables[4, 0] = 8             # a row of another prompt
    assert shared_prefix(tables, lens, block_size) is None
    tables[4, 0] = 7
    assert shared_prefix(tables[:PREFIX_MIN_ROWS - 1], lens[:PREFIX_MIN_ROWS - 1], block_size) is None


@needs_amx
@pytest.mark.slow
def test_the_default_model_on_bf16_math_drifts_no_more_with_the_prefix_path(default_model_path, fp32_model,
                                                                             monkeypatch):
    """48 sequences sharing a 9-block prompt, prefilled together after it and decoded with forced
    tokens through the fused bf16 layers: with the prefix on the tiles (every step here) the logits
    follow the float32 model as closely as without it, and pick the same top-1 wherever that leads."""
    from nightshift.engine.layers import cpu_math
    from nightshift.engine.loader import load_model
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here")
    model = load_model(default_model_path, dtype=torch.float32, cpu_math="bf16")
    g = torch.Generator().manual_seed(3)
    rows, shared = PREFIX_MIN_ROWS, 9 * 16
    assert shared >= PREFIX_MIN_POSITIONS
    prompt = torch.randint(100, 40000, (shared,), generator=g).tolist()
    own = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (rows,), generator=g)]
    forced = torch.randint(100, 40000, (rows, 4), generator=g).tolist()
    calls = []
    prefix_attention = cpu_prefix_attention.prefix_attention
    monkeypatch.setattr(cpu_prefix_attention, "prefix_attention", lambda *a: calls.append(1) or prefix_attention(*a))

    def no_prefix(patch) -> None:
        patch.setattr(cpu_kernel_backend, "PREFIX_MIN_ROWS", 10 ** 9)

    def run(m, patches=None) -> torch.Tensor:      # the continuations' step and the decode steps
        return shared_prompt_logits(m, monkeypatch, prompt, own, forced, patches)[1:]

    with_prefix = run(model)
    assert len(calls) == 5 * model.config.num_layers      # the prefill step and four decode steps, every layer
    without = run(model, no_prefix)
    reference = run(fp32_model, no_prefix)
    assert len(calls) == 5 * model.config.num_layers
    kl = lambda x: torch.nn.functional.kl_div(x.log_softmax(-1), reference.log_softmax(-1), log_target=True,  # noqa: E731
                                              reduction="batchmean").item()
    assert kl(with_prefix) <= 1.25 * kl(without) + 1e-4, (kl(with_prefix), kl(without))
    top2 = without.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.25
    assert clear.sum() >= 100, clear.sum()
    assert torch.equal(with_prefix.argmax(-1)[clear], without.argmax(-1)[clear])

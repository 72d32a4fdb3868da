"""Triton paged prefill attention against the torch reference: several sequences in one flat
batch, each a chunk of new tokens after a cached prefix (0 for a fresh prompt), over shuffled
blocks, with GQA; chunks longer than one query tile; a decode-like one-token chunk."""
import math

import pytest
import torch

from kernel_cases import kernel_dtypes, random_block_tables, random_pool, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from nightshift.engine.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kernel_reference import prefill_attention_reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run_case(chunks, heads, kv_heads, head_dim, page, dtype, block_m=16, block_n=16, seed=0):
    """chunks: (cached tokens, new tokens) per sequence."""
    lengths = [cached + new for cached, new in chunks]
    num_blocks = sum((n + page - 1) // page for n in lengths) + 2
    k_cache, v_cache = random_pool(num_blocks, page, kv_heads, head_dim, dtype, DEVICE, seed)
    tables = random_block_tables(lengths, page, num_blocks, seed).to(DEVICE)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(starts[-1], heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(device=DEVICE, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, query_start_loc, lens, scale,
                                  block_m=block_m, block_n=block_n)
    ref = prefill_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, query_start_loc,
                                      lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err < TOLERANCE[dtype], (chunks, dtype, err)


@pytest.mark.parametrize("dtype", kernel_dtypes())
def test_prefill_after_cached_prefix_gqa(dtype):
    # a prefix-cache hit of 24 tokens + 20 new; a fresh 9-token prompt; a 1-token chunk after 7
    run_case([(24, 20), (0, 9), (7, 1)], heads=4, kv_heads=2, head_dim=32, page=8, dtype=dtype)


def test_prefill_chunk_spanning_several_query_tiles():
    # 40 new rows in tiles of 16 (the last one partly padded) after 13 cached tokens
    run_case([(13, 40), (0, 3)], heads=2, kv_heads=1, head_dim=16, page=4, dtype=torch.float32, seed=2)


def test_prefill_head_dim_not_power_of_two():
    run_case([(5, 6)], heads=3, kv_heads=3, head_dim=24, page=16, dtype=torch.float32, seed=4)


def test_prefill_rejects_bad_query_start_loc():
    k_cache, v_cache = random_pool(2, 4, 1, 16, torch.float32, DEVICE)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc has 2 entries for 2 sequences"):
        paged_prefill_attention(torch.randn(3, 1, 16, device=DEVICE), k_cache, v_cache, tables,
                                torch.tensor([0, 3], dtype=torch.int32, device=DEVICE),
                                torch.tensor([2, 1], dtype=torch.int32, device=DEVICE), 0.25)

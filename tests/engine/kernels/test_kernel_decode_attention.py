"""Triton paged decode attention against the torch reference: a batch of mixed context lengths
over shuffled, non-contiguous blocks, GQA group sizes 1/4/3 (odd: padded rows), head dims that
are and are not powers of two, one and several context partitions (split-KV + merge)."""
import math

import pytest
import torch

from kernel_cases import kernel_dtypes, random_block_tables, random_pool, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from nightshift.engine.kernels.decode_attention import (choose_partition_size, merge_partitions,  # noqa: E402
                                             paged_decode_attention)
from kernel_reference import decode_attention_reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run_case(context_lens, heads, kv_heads, head_dim, page, dtype, partition_size, block_n=16, seed=0):
    num_blocks = sum((n + page - 1) // page for n in context_lens) + 3
    k_cache, v_cache = random_pool(num_blocks, page, kv_heads, head_dim, dtype, DEVICE, seed)
    tables = random_block_tables(context_lens, page, num_blocks, seed).to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(device=DEVICE, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=max(context_lens),
                                 partition_size=partition_size, block_n=block_n)
    ref = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err < TOLERANCE[dtype], (context_lens, heads, kv_heads, head_dim, dtype, err)


@pytest.mark.parametrize("dtype", kernel_dtypes())
def test_decode_mixed_lengths_gqa(dtype):
    run_case([1, 17, 40, 5], heads=8, kv_heads=2, head_dim=32, page=8, dtype=dtype, partition_size=64)


def test_decode_split_kv_partitions_merge_exactly():
    # contexts up to 70 in partitions of 16: 5 partitions, the short sequences' later ones empty
    run_case([70, 3, 33, 16], heads=2, kv_heads=2, head_dim=16, page=4, dtype=torch.float32, partition_size=16)


def test_decode_odd_group_and_head_dim():
    # 6 query heads over 2 KV heads (group 3, padded to 16 rows), head_dim 40 (padded to 64)
    run_case([9, 30], heads=6, kv_heads=2, head_dim=40, page=16, dtype=torch.float32, partition_size=32, seed=3)


def test_decode_page_larger_than_tile():
    run_case([50, 21], heads=2, kv_heads=1, head_dim=16, page=32, dtype=torch.float32, partition_size=64)


def test_decode_default_partitioning():
    # 3 sequences x 1 KV head: split into partitions of min_partition=128 positions -> 2 here
    assert choose_partition_size(3, 1, 200, 32) == 128
    run_case([200, 7, 130], heads=2, kv_heads=1, head_dim=16, page=16, dtype=torch.float32, partition_size=None,
             block_n=32)


def test_choose_partition_size():
    assert choose_partition_size(256, 8, 1000, 32) == 1024          # enough programs: one partition
    assert choose_partition_size(1, 8, 4096, 32) == 128             # batch 1: 32 partitions of 128
    assert choose_partition_size(1, 8, 100000, 32) == 3040          # long context: 33 x 8 >= 264 programs
    assert choose_partition_size(2, 8, 40, 32) == 64                # short context: never past the context
    assert choose_partition_size(1, 1, 0, 32) == 32


def test_merge_partitions_skips_empty_partitions():
    partial = torch.randn(2, 3, 4, 8)
    lse = torch.randn(2, 4, 3)
    lse[1, :, 2] = float("-inf")                       # sequence 1 never reached partition 2
    merged = merge_partitions(partial, lse)
    w = torch.softmax(lse[1, 0, :2], dim=0)
    assert torch.allclose(merged[1, 0], w[0] * partial[1, 0, 0] + w[1] * partial[1, 1, 0], atol=1e-6)


def test_decode_rejects_bad_partition_and_shapes():
    k_cache, v_cache = random_pool(4, 4, 2, 16, torch.float32, DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode_attention(torch.randn(1, 4, 16, device=DEVICE), k_cache, v_cache, tables, lens, 0.25,
                               partition_size=40, block_n=16)
    with pytest.raises(ValueError, match="does not fit a pool"):
        paged_decode_attention(torch.randn(1, 3, 16, device=DEVICE), k_cache, v_cache, tables, lens, 0.25)

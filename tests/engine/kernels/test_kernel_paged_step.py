"""One mixed step on the kernel path: slot mapping and block tables built from scheduled items,
new K/V stored with the store_kv kernel, then decode + prefill kernels, against the references."""
import math
from dataclasses import dataclass

import pytest
import torch

from kernel_cases import random_pool, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from nightshift.engine.kernels.paged import build_paged_metadata, paged_kernel_attention  # noqa: E402
from kernel_reference import (decode_attention_reference, prefill_attention_reference,  # noqa: E402
                                      store_kv_reference)
from nightshift.engine.kernels.store_kv import store_kv  # noqa: E402


@dataclass
class Item:
    token_ids: list
    start_pos: int
    block_table: list


def test_slot_mapping_follows_block_tables():
    items = [Item([7], 5, [3, 9]), Item([1, 2, 3], 2, [4, 8, 0])]
    slots, meta = build_paged_metadata(items, num_decode=1, block_size=4, device="cpu")
    # position 5 of [3, 9] -> block 9 row 1; positions 2..4 of [4, 8] -> block 4 rows 2, 3, block 8 row 0
    assert slots.tolist() == [9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 8 * 4]
    assert meta.decode_context_lens.tolist() == [6] and meta.max_decode_len == 6
    assert meta.decode_block_tables.tolist() == [[3, 9]] and meta.prefill_block_tables.tolist() == [[4, 8]]
    with pytest.raises(ValueError, match="item 1 needs 2 blocks, its block_table has 1"):
        build_paged_metadata([items[0], Item([1, 2, 3], 2, [4])], num_decode=1, block_size=4, device="cpu")


def test_slot_mapping_prefill_across_blocks_and_offsets():
    items = [Item([1, 2, 3, 4], 2, [6, 1])]
    slots, meta = build_paged_metadata(items, num_decode=0, block_size=4, device="cpu")
    assert slots.tolist() == [6 * 4 + 2, 6 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]
    assert meta.prefill_query_start_loc.tolist() == [0, 4] and meta.prefill_context_lens.tolist() == [6]
    assert meta.num_decode == 0 and meta.max_prefill_len == 4


def test_decode_items_must_be_single_tokens():
    with pytest.raises(ValueError, match="decode items need exactly one new token"):
        build_paged_metadata([Item([1, 2], 3, [0])], num_decode=1, block_size=4, device="cpu")


def test_mixed_step_matches_references():
    page, kv_heads, heads, dim = 4, 2, 4, 16
    items = [Item([0], 6, [5, 2]), Item([0], 13, [0, 7, 3, 11]),                 # decode rows
             Item([0] * 5, 3, [1, 4]), Item([0] * 6, 0, [8, 10]), Item([0], 9, [6, 9, 12])]  # prefill chunks
    k_cache, v_cache = random_pool(13, page, kv_heads, dim, torch.float32, DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots, meta = build_paged_metadata(items, num_decode=2, block_size=page, device=DEVICE)
    tokens = slots.shape[0]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(tokens, h, dim, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    store_kv(k_cache, v_cache, k, v, slots)
    store_kv_reference(k_ref, v_ref, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    scale = 1 / math.sqrt(dim)
    out = paged_kernel_attention(q, k_cache, v_cache, meta, scale)
    ref = torch.cat([
        decode_attention_reference(q[:2], k_ref, v_ref, meta.decode_block_tables, meta.decode_context_lens, scale),
        prefill_attention_reference(q[2:], k_ref, v_ref, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                    meta.prefill_context_lens, scale)])
    assert out.shape == q.shape
    assert (out - ref).abs().max().item() < 1e-5

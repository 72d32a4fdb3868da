"""One mixed step on the Triton backend: slot mapping and block tables built from scheduled items,
new K/V stored with the store_kv kernel, then decode + prefill kernels, against the references."""
import math
from dataclasses import dataclass

import pytest
import torch

from kernel_cases import random_pool, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from kernel_reference import (decode_attention_reference, prefill_attention_reference,  # noqa: E402
                              store_kv_reference)
from nightshift.engine.attention.triton_backend import TritonAttention  # noqa: E402
from nightshift.engine.model_config import ModelConfig  # noqa: E402


@dataclass
class Item:
    token_ids: list
    start_pos: int
    block_table: list


def backend(block_size: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
            device: str = "cpu") -> TritonAttention:
    config = ModelConfig(architecture="llama", hidden_size=heads * head_dim, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=64, vocab_size=100,
                         rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True)
    return TritonAttention(config, block_size, torch.float32, torch.device(device))


def test_slot_mapping_follows_block_tables():
    items = [Item([7], 5, [3, 9]), Item([1, 2, 3], 2, [4, 8, 0])]
    meta = backend(block_size=4).build_metadata(items)
    # position 5 of [3, 9] -> block 9 row 1; positions 2..4 of [4, 8] -> block 4 rows 2, 3, block 8 row 0
    assert meta.slot_mapping.tolist() == [9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 8 * 4]
    assert meta.item_order == [0, 1] and meta.num_decode == 1
    assert meta.decode_context_lens.tolist() == [6] and meta.max_decode_len == 6
    assert meta.decode_block_tables.tolist() == [[3, 9]] and meta.prefill_block_tables.tolist() == [[4, 8]]
    with pytest.raises(ValueError, match="item 1 needs 2 blocks, its block_table has 1"):
        backend(block_size=4).build_metadata([items[0], Item([1, 2, 3], 2, [4])])


def test_slot_mapping_prefill_across_blocks_and_offsets():
    items = [Item([1, 2, 3, 4], 2, [6, 1])]
    meta = backend(block_size=4).build_metadata(items)
    assert meta.slot_mapping.tolist() == [6 * 4 + 2, 6 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]
    assert meta.prefill_query_start_loc.tolist() == [0, 4] and meta.prefill_context_lens.tolist() == [6]
    assert meta.num_decode == 0 and meta.max_prefill_len == 4


def test_decode_rows_come_first_and_only_single_tokens_after_a_cached_one_decode():
    # a fresh one-token prompt and a two-token chunk after a cached prefix are prefill chunks
    items = [Item([1], 0, [0]), Item([1, 2], 3, [1, 3]), Item([5], 3, [2])]
    meta = backend(block_size=4).build_metadata(items)
    assert meta.num_decode == 1 and meta.item_order == [2, 0, 1]
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, 0, 1 * 4 + 3, 3 * 4]
    assert meta.prefill_query_start_loc.tolist() == [0, 1, 3] and meta.prefill_context_lens.tolist() == [1, 5]


def test_mixed_step_matches_references():
    page, kv_heads, heads, dim = 4, 2, 4, 16
    items = [Item([0], 6, [5, 2]), Item([0] * 5, 3, [1, 4]), Item([0], 13, [0, 7, 3, 11]),   # decode, prefill, decode
             Item([0] * 6, 0, [8, 10]), Item([0], 9, [6, 9, 12])]                         # prefill, decode
    attention = backend(page, heads, kv_heads, dim, DEVICE)
    k_cache, v_cache = random_pool(13, page, kv_heads, dim, torch.float32, DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    meta = attention.build_metadata(items)
    assert meta.item_order == [0, 2, 4, 1, 3] and meta.num_decode == 3
    tokens = meta.slot_mapping.shape[0]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(tokens, h, dim, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    attention.store_kv(k_cache, v_cache, k, v, meta)
    store_kv_reference(k_ref, v_ref, k, v, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    scale = 1 / math.sqrt(dim)
    out = attention.forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = torch.cat([
        decode_attention_reference(q[:3], k_ref, v_ref, meta.decode_block_tables, meta.decode_context_lens, scale),
        prefill_attention_reference(q[3:], k_ref, v_ref, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                    meta.prefill_context_lens, scale)])
    assert out.shape == q.shape
    assert (out - ref).abs().max().item() < 1e-5

"""Triton store_kv against the torch reference (CPU interpreter without CUDA, else the GPU)."""
import pytest
import torch

from kernel_cases import kernel_dtypes, random_pool, use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from kernel_reference import store_kv_reference  # noqa: E402
from nightshift.engine.kernels.store_kv import store_kv  # noqa: E402


@pytest.mark.parametrize("dtype", kernel_dtypes())
def test_store_kv_writes_rows_at_their_slots_and_nothing_else(dtype):
    blocks, page, kv_heads, head_dim = 6, 4, 2, 24      # row of 48: not a power of two
    k_cache, v_cache = random_pool(blocks, page, kv_heads, head_dim, dtype, DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 0, 23, -1, 9, 17], dtype=torch.int64, device=DEVICE)   # -1: padding row
    # v as a column slice of a fused projection output (row stride > row size), k float32
    fused = torch.randn(len(slots), 3 * kv_heads * head_dim, device=DEVICE)
    k = torch.randn(len(slots), kv_heads, head_dim, device=DEVICE)
    v = fused[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(len(slots), kv_heads, head_dim).to(dtype)
    store_kv(k_cache, v_cache, k, v, slots)
    store_kv_reference(k_ref, v_ref, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[23], k[2].to(dtype))


def test_store_kv_int32_slots_and_large_rows():
    blocks, page, kv_heads, head_dim = 3, 2, 8, 160     # row of 1280: two passes of the 1024 block
    k_cache, v_cache = random_pool(blocks, page, kv_heads, head_dim, torch.float32, DEVICE)
    k = torch.randn(3, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(3, kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([4, 1, 3], dtype=torch.int32, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k_cache, v_cache, k, v, slots)
    store_kv_reference(k_ref, v_ref, k, v, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_mismatched_rows():
    k_cache, v_cache = random_pool(2, 2, 1, 16, torch.float32, DEVICE)
    k = torch.randn(3, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="2 slots for 3 k rows"):
        store_kv(k_cache, v_cache, k, k, torch.tensor([0, 1], device=DEVICE))

"""The CPU K/V pool on huge pages (engine/cpu_allocator.py huge_page_zeros, engine/kv_cache.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from nightshift.engine.cpu_allocator import HUGE_PAGE, huge_page_zeros, keep_large_allocations
from nightshift.engine.kv_cache import allocate_kv_caches
from nightshift.engine.model_config import ModelConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pool_is_zeroed_and_on_huge_pages_where_the_kernel_gives_them():
    keep_large_allocations()          # as the engine does (freed blocks stay in the heap, touched)
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)     # ... so reusing one would give 4 KiB pages
    mode = THP.read_text() if THP.exists() else "[never]"
    # ~3.5 MiB each: one whole 2 MiB page only when it starts on a 2 MiB boundary, which Linux's
    # placement of such mappings (any 4 KiB boundary) left to chance: a quarter of them held none
    tensors = [huge_page_zeros((600, 16, 3, 64), torch.bfloat16) for _ in range(8)]
    for tensor in tensors:
        assert tensor.shape == (600, 16, 3, 64) and tensor.dtype == torch.bfloat16
        assert not tensor.any()
        assert tensor.data_ptr() % HUGE_PAGE == 0
        if "[never]" not in mode:        # "madvise" (asked for here) or "always"
            assert huge_bytes_at(tensor.data_ptr()) >= HUGE_PAGE, mode


def test_the_cpu_pool_has_every_layers_k_and_v_apart():
    config = ModelConfig(architecture="llama", hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=128, tie_word_embeddings=True)
    # 16,384 blocks of 256 bytes: 4 MiB a tensor, so each on a mapping of its own (huge_page_zeros)
    pool = allocate_kv_caches(config, num_blocks=16384, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    assert len(pool) == 3
    for k, v in pool:
        assert k.shape == v.shape == (16384, 4, 2, 8) and k.is_contiguous() and v.is_contiguous()
        assert not k.any() and not v.any()
    pool[1][0].fill_(1.0)            # one layer's K written: nothing else moves
    assert all(not t.any() for kv in pool for t in kv if t is not pool[1][0])

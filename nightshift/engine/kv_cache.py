"""The paged KV pool: its layout, its size per block, and its allocation.

Per layer, k_cache and v_cache are `[num_blocks, block_size, kv_heads, head_dim]`, contiguous.
Position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`
of the flattened pool; the block manager hands out the block ids, the attention backends
(engine/attention/) write and read the slots.
"""
from __future__ import annotations

import torch

from nightshift.engine.cpu_allocator import huge_page_zeros
from nightshift.engine.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]      # (k_cache, v_cache) of one layer


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, all layers, for one block of `block_size` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[KVCache]:
    """A zeroed pool of `num_blocks` blocks for every layer (on CPU, on huge pages where the kernel
    gives them: cpu_allocator.huge_page_zeros)."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    on_cpu = torch.device(device).type == "cpu"

    def zeros() -> torch.Tensor:
        return huge_page_zeros(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)
    return [(zeros(), zeros()) for _ in range(config.num_layers)]

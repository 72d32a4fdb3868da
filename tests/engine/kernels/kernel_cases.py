"""Shared set-up of the kernel tests: the device they run on and random paged pools.

On a machine without CUDA the tests run the kernels in Triton's CPU interpreter; the test
modules set TRITON_INTERPRET=1 (through `use_interpreter_without_cuda`) before importing them.
"""
from __future__ import annotations

import os

import torch


def use_interpreter_without_cuda() -> str:
    """Call before importing nightshift.engine.kernels.*: the device the kernel tests run on."""
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def kernel_dtypes() -> list:
    """float32 and float16 everywhere; bfloat16 only on a GPU: Triton's CPU interpreter moves
    bfloat16 tensors through float32 with truncation (it rewrites even untouched entries)."""
    return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def random_pool(num_blocks: int, page: int, kv_heads: int, head_dim: int, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, page, kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(device=device, dtype=dtype),
            torch.randn(shape, generator=g).to(device=device, dtype=dtype))


def random_block_tables(context_lens: list[int], page: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Disjoint, shuffled blocks per sequence, padded with -1 past each sequence's blocks
    (entries the kernels must never read); `[B, max_blocks]` int32."""
    g = torch.Generator().manual_seed(seed)
    needed = [(n + page - 1) // page for n in context_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, pool has {num_blocks}")
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(needed)
    tables, used = [], 0
    for count in needed:
        tables.append(order[used:used + count] + [-1] * (width - count))
        used += count
    return torch.tensor(tables, dtype=torch.int32)

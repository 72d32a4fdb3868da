"""Triton: write new K/V rows into the paged pool by slot mapping.

One program per new token copies its `kv_heads * head_dim` K and V values to flat pool slot
`slot_mapping[t]` (= block * block_size + offset); a negative slot is padding and writes nothing
(so a CUDA-graph-padded batch can carry dummy rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, ROW, BLOCK):
        idx = start + offsets
        mask = (idx < ROW) & ((idx * 0 + slot) >= 0)   # (a scalar mask operand trips the interpreter)
        k = tl.load(k_ptr + token * stride_k + idx, mask=mask)
        v = tl.load(v_ptr + token * stride_v + idx, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + idx, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + idx, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x `[T, kv_heads, D]` with each token's heads contiguous (a row stride is fine: v is
    usually a column slice of the fused qkv output)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"store_kv: {name} must be [T, kv_heads, head_dim] with contiguous heads, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    return x


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v `[T, kv_heads, head_dim]` into k_cache, v_cache `[num_blocks, block_size,
    kv_heads, head_dim]` (contiguous) at flat slots `slot_mapping` `[T]` (int32/int64)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: the KV pool must be contiguous")
    tokens = slot_mapping.shape[0]
    if k.shape[0] != tokens or v.shape[0] != tokens:
        raise ValueError(f"store_kv: {tokens} slots for {k.shape[0]} k rows and {v.shape[0]} v rows")
    if tokens == 0:
        return
    k, v = _rows(k, "k"), _rows(v, "v")
    row = k_cache.shape[2] * k_cache.shape[3]
    block = min(triton.next_power_of_2(row), 1024)
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                ROW=row, BLOCK=block)

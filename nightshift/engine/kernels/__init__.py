"""Attention kernels over the paged KV pool (layout: engine/kv_cache.py); the backends of
engine/attention/ call them (see README.md).

Triton (the CUDA path, TritonAttention):
* store_kv.py              write new K/V rows into the paged pool by slot mapping
* decode_attention.py      one query token per sequence, mixed context lengths, GQA, split-KV
* prefill_attention.py     a chunk of new tokens per sequence whose earlier tokens are in the pool
* paged_tile.py            the pieces both attention kernels share (input checks, K/V tile loads)

C (CPU float32 decode rows, CpuKernelAttention):
* cpu_paged_attention.py   built with the system compiler on first use, called through ctypes

The Triton modules import triton at import time and define their kernels then; tests set
TRITON_INTERPRET=1 before importing them to run the kernels on CPU (plain-torch references of
all three are in tests/engine/kernels/kernel_reference.py).
"""

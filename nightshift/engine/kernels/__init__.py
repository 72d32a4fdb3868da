"""Triton kernels for the CUDA path of the paged KV cache (issue 4).

* store_kv.py            write new K/V rows into the paged pool by slot mapping
* decode_attention.py    one query token per sequence, mixed context lengths, GQA, split-KV
* prefill_attention.py   a chunk of new tokens per sequence whose earlier tokens are in the pool
* reference.py           the same three in plain torch (what the kernels are tested against)

Pool layout (as engine/attention.py): k_cache, v_cache `[num_blocks, block_size, kv_heads, head_dim]`;
position p of a sequence lives in block `block_table[p // block_size]`, row `p % block_size`.
The modules import triton at import time and define their kernels then; tests set
TRITON_INTERPRET=1 before importing them to run the kernels on CPU (see README.md).
"""

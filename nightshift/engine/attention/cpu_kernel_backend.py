"""CpuKernelAttention: every row of a step through the C kernel, decode rows and prefill chunks alike.

The C kernel (engine/kernels/cpu_paged_attention.py) reads each query row's K/V in place through
its block table, so one call takes every row: a decode row attends to its whole sequence, row j of
a prefill chunk after `start` cached tokens to positions 0 .. start + j (its chunk's K/V are stored
first), with the model's sliding window and soft-capping where a layer has them. No families,
buckets, cascade prefix, gathered K/V or masks are needed: rows sharing blocks (a prefix-cache hit,
a chunk's own positions) re-read them from cache. Against the torch path's SDPA over the gathered
context with a causal mask (TorchAttention's prefill spans), one layer's attention call timed alone
on a 2-core AVX-512 EPYC (an ad-hoc timing, not a bench command) took 0.21 / 1.08 / 3.03 ms for a
chunk of 64 / 256 / 512 tokens after 208 cached ones against 0.34 / 1.97 / 5.19, and 6.2 ms for a
fresh 1024-token prompt against SDPA's causal 10.4 ms (float32 queries, bfloat16 pool); `python -m
bench.runner`'s 256-token prefill chunk went 131 -> 107 ms. A row's result depends on that row
alone, prefill rows included. CPU and float32 only; the selection (engine/attention/__init__.py)
checks `cpu_paged_attention.supports` first.

Shared prefix on AMX: when every row of a step starts with the same blocks (a batch sharing its
system prompt) and there are at least ``PREFIX_MIN_ROWS`` rows and ``PREFIX_MIN_POSITIONS``
shared positions, over a bfloat16 pool without a window or soft-capping, on a CPU with AMX tiles
(kernels/cpu_prefix_attention.py), those blocks are attended by all rows at once as tile matrix
products and the paged kernel reads only each row's positions after them, merging the two softmax
parts. On a 2-core AMX Xeon (2 threads): ad hoc, the 256-row decode call over 220-390 positions
with a 13-block prefix, the pool in cache, took 1.37-1.40 ms row by row against 1.05-1.08 ms (0.41
ms of it the prefix on the tiles, most of that its softmax, not its products); in the standard
workload's run (pool in memory, prefill steps too) the attention calls took 9.44 s row by row
against 8.82 s (2.53 s on the tiles, 6.29 s for the positions after the prefix); `python -m
bench.engine --skip-hf` with and without it, alternating: 1,532.1 / 1,516.6 and 1,531.6 / 1,514.3
output tok/s (+1%). Its products round as the paged kernel's bfloat16 products do (the scaled
query and the probabilities to bfloat16; since 2026-12-01: three bfloat16 parts each, float32's
products, had taken 1.6x the time), and a row's bits then depend on whether its step shares the
prefix (as the bf16 GEMMs on AMX already depend on the step's row count).
NIGHTSHIFT_CPU_PREFIX_ATTENTION=0 turns it off.

Prefill chunks as tiles: over a bfloat16 pool on a CPU with AVX-512 BF16, or a float32 pool on one
with AVX-512 (and without the AMX prefix path above for the step; sliding windows included,
soft-capping not), every prefill chunk's rows (a run: one sequence's rows, after the step's decode
rows) go to kernels/cpu_prefill_attention.py, 16 rows of a query head a register tile; the decode
rows and chunks of fewer than TILE_MIN_ROWS rows (where tiles measured no faster) stay on the paged
kernel, and over a float32 pool the chunks of fewer than F32_TILE_MIN_ROWS rows or over contexts
shorter than F32_TILE_MIN_CONTEXT positions too. The tiles give each row the paged kernel's bits,
so the choice (which follows a chunk's length, so the step's token budget and the batch) changes no
result: a row's result depends on that row alone. On a 2-core Zen 5, `bench.runner`'s 1,024-token
chunk over 1,024 cached: 564.1-568.8 -> 451.2-465.6 ms on the bf16 math, 1,152.7-1,170.7 ->
959.2-968.3 ms on the float32 math (README). NIGHTSHIFT_CPU_PREFILL_ATTENTION=0 turns it off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nightshift.engine.attention.base import AttentionBackend, StepMetadata, padded_block_tables, pool_slots
from nightshift.engine.attention.torch_paged import index_copy_kv
from nightshift.engine.kernels import cpu_exact_rope, cpu_paged_attention, cpu_prefill_attention, cpu_prefix_attention
from nightshift.engine.step import StepItem, decode_indices


@dataclass
class KernelRows:
    """Every row of the flat batch, as the C kernel reads them."""
    num_rows: int
    block_tables: torch.Tensor              # [num_rows, width] int32: each row's sequence's blocks, zero-padded
    context_lens: torch.Tensor              # [num_rows] int32: positions the row attends to (itself included)
    prefix_blocks: Optional[torch.Tensor] = None   # [k] int32: blocks every row starts with (shared_prefix)
    num_paged: int = 0                      # the first rows: decode rows, then chunks too short for tiles
    runs: Optional[torch.Tensor] = None     # [k, 2] int64: first row and rows of each longer chunk after them
    # over a float32 pool (float32 tiles pay only for longer chunks over longer contexts): the runs
    # that go to tiles, and the rows of the others (with the first num_paged) for the paged kernel
    f32_runs: Optional[torch.Tensor] = None
    f32_paged: Optional[torch.Tensor] = None   # [m] int64 row indices; None: only the first num_paged


@dataclass
class CpuKernelMetadata(StepMetadata):
    rows: Optional[KernelRows] = None       # None: an empty step


# Below these the row-by-row kernel, which reads a shared prefix from cache, is as fast (a 2-core
# AMX Xeon, 2026-11-26, ad hoc: 64 rows x 208 prefix positions 1.10x, 256 x 64 1.00x, 32 x 208
# 0.94x; on another, 2026-12-01, with the rounded prefix: 128 positions at 16 rows 1.12x, 96 at 64
# rows 1.02x, 64 at 256 rows 1.09x ad hoc, but in the engine's 32-row steps no faster: the kernels
# README, "A 2-core Intel Xeon with AMX again")
PREFIX_MIN_ROWS = 48
PREFIX_MIN_POSITIONS = 128
# A prefill chunk of fewer rows than this stays on the paged kernel: a tile of 16 lanes with few
# rows in it, and the chunk's V interleaved for them alone, cost more than the rows one by one (the
# same bits either way; 2-core Zen 5, ad hoc, chunks after 260 cached positions, paged kernel /
# tiles: 256 chunks of 1 row 1.7-1.8 / 11.8 ms, 200 of 4 rows 3.2 / 9.2-9.6, 100 of 8 2.0 / 4.0, 64 of
# 12 1.6 / 1.8, 64 of 16 2.15-2.26 / 1.98-2.39, 32 of 32 2.1 / 1.53-1.56)
TILE_MIN_ROWS = 16
# Over a float32 pool tiles pay later: for chunks of at least this many rows whose last row reads at
# least this many positions (the same bits either way; 2-core Zen 5, ad hoc, paged kernel / tiles,
# float32 pool: 16 chunks of 57 rows after 208 2.57 / 2.49 ms, 32 of 32 after 260 3.75 / 4.0, 16 of
# 64 after 260 3.6-3.75 / 3.35-3.74, 32 of 32 after 1,000 18.3-18.5 / 15.7-16.0, 16 of 64 after 1,000
# 17.0-17.3 / 13.3-13.7, 1,024 after 1,024 23.0 / 14.4)
F32_TILE_MIN_ROWS = 32
F32_TILE_MIN_CONTEXT = 512


def shared_prefix(tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> Optional[torch.Tensor]:
    """The block ids every row's table starts with, each row keeping at least one position after
    them; None with fewer than PREFIX_MIN_ROWS rows or a prefix shorter than PREFIX_MIN_POSITIONS."""
    if tables.shape[0] < PREFIX_MIN_ROWS:
        return None
    same = (tables == tables[:1]).all(dim=0).to(torch.int32)
    blocks = min(int(same.cumprod(0).sum()), int((lens.min() - 1) // block_size))
    return tables[0, :blocks].contiguous() if blocks * block_size >= PREFIX_MIN_POSITIONS else None


class CpuKernelAttention(AttentionBackend):
    name = "cpu-kernel"

    def build_metadata(self, items: Sequence[StepItem]) -> CpuKernelMetadata:
        decode = decode_indices(items)
        decode_set = set(decode)
        chunks = [i for i in range(len(items)) if i not in decode_set]
        # decode rows, then the chunks too short for tiles (all on the paged kernel), then the others
        short = [i for i in chunks if len(items[i].token_ids) < TILE_MIN_ROWS]
        order = decode + short + [i for i in chunks if len(items[i].token_ids) >= TILE_MIN_ROWS]
        meta = CpuKernelMetadata(item_order=order, slot_mapping=torch.empty(0, dtype=torch.long))
        if not items:
            return meta
        counts = torch.tensor([len(items[i].token_ids) for i in order], dtype=torch.long)
        starts = torch.tensor([items[i].start_pos for i in order], dtype=torch.long)
        tables = padded_block_tables([items[i].block_table for i in order]).repeat_interleave(counts, dim=0)
        first_row = torch.cumsum(counts, 0) - counts
        rows = int(counts.sum())
        positions = torch.repeat_interleave(starts - first_row, counts) + torch.arange(rows)
        meta.slot_mapping = pool_slots(tables, positions[:, None], self.block_size).view(-1).to(self.device)
        tables, lens = tables.to(torch.int32), (positions + 1).to(torch.int32)
        prefix = shared_prefix(tables, lens, self.block_size) if cpu_prefix_attention.load() is not None else None
        paged = len(decode) + len(short)        # items on the paged kernel; each later one a run of rows
        runs = torch.stack([first_row, counts], dim=1)[paged:] if paged < len(order) else None
        num_paged = int(counts[:paged].sum())
        meta.rows = KernelRows(rows, tables, lens, prefix, num_paged, runs)   # no AMX: no prefix kernel to look for
        if runs is not None:
            last = lens[runs[:, 0] + runs[:, 1] - 1]
            wide = (runs[:, 1] >= F32_TILE_MIN_ROWS) & (last >= F32_TILE_MIN_CONTEXT)
            meta.rows.f32_runs = runs[wide]
            if not bool(wide.all()):
                narrow = [torch.arange(first, first + count) for first, count in runs[~wide].tolist()]
                meta.rows.f32_paged = torch.cat([torch.arange(num_paged), *narrow])
        return meta

    def store_kv(self, k_cache, v_cache, k, v, meta: CpuKernelMetadata) -> None:
        index_copy_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def rope_store(self, qk, v, cos, sin, k_cache, v_cache, meta: CpuKernelMetadata, num_heads: int):
        """float32 q, k, v and pool: the C pass of kernels/cpu_exact_rope.py (the torch ops' bits)."""
        if not cpu_exact_rope.fits(qk, v, cos, k_cache, v_cache):
            return None
        return cpu_exact_rope.rope_store(qk, v, cos, sin, meta.slot_mapping, k_cache, v_cache, num_heads)

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuKernelMetadata, scale: float,
                window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
        rows = meta.rows
        if rows is None:
            return torch.empty_like(q)
        if (rows.prefix_blocks is not None and window is None and softcap is None
                and cpu_prefix_attention.supports(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.dtype)):
            out, lse = cpu_prefix_attention.prefix_attention(q, k_cache, v_cache, rows.prefix_blocks, scale)
            return cpu_paged_attention.paged_attention_after_prefix(
                q, k_cache, v_cache, rows.block_tables, rows.context_lens, scale,
                rows.prefix_blocks.numel() * self.block_size, out, lse)
        if (rows.runs is not None and softcap is None
                and cpu_prefill_attention.supports(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.dtype,
                                                  k_cache.shape[1])):
            return self._prefill_tiles(q, k_cache, v_cache, rows, scale, window)
        return cpu_paged_attention.paged_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens, scale,
                                                   window=window, softcap=softcap)

    @staticmethod
    def _prefill_tiles(q, k_cache, v_cache, rows: KernelRows, scale: float, window: Optional[int]) -> torch.Tensor:
        """The first ``num_paged`` rows (decode rows, short chunks) through the paged kernel, every
        other prefill chunk's rows as tiles (kernels/cpu_prefill_attention.py); over a float32 pool
        only the runs of ``f32_runs`` as tiles, the other runs' rows with the paged ones."""
        out = torch.empty_like(q)
        runs, d = rows.runs, rows.num_paged
        if k_cache.dtype == torch.float32:
            runs = rows.f32_runs
            if runs.shape[0] == 0:          # no chunk for the float32 tiles: every row as before
                return cpu_paged_attention.paged_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens,
                                                           scale, window=window)
            if rows.f32_paged is not None:
                at = rows.f32_paged
                out[at] = cpu_paged_attention.paged_attention(q[at], k_cache, v_cache, rows.block_tables[at],
                                                              rows.context_lens[at], scale, window=window)
                d = 0
        if d:
            out[:d] = cpu_paged_attention.paged_attention(q[:d], k_cache, v_cache, rows.block_tables[:d],
                                                          rows.context_lens[:d], scale, window=window)
        if runs.shape[0] == 0:
            return out
        return cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens,
                                                       scale, runs, out, window)

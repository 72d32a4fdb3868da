"""The kernel path of one model step: block tables and lengths for the Triton attention kernels.

The model runner puts decode sequences (one new token each) first in the flat batch, then the
prefill chunks. `build_paged_metadata` turns that row order into what the kernels read: the slot
of every new token (for store_kv), and per group the block tables (int32, padded with block 0,
never read past a sequence's length), context lengths and, for prefills, row offsets. The host
also keeps the longest decode context and the longest chunk, so the kernels' grids need no
device sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from nightshift.engine.kernels.decode_attention import paged_decode_attention
from nightshift.engine.kernels.prefill_attention import paged_prefill_attention


class ScheduledChunk(Protocol):          # engine.model_runner.StepItem fits
    token_ids: list[int]
    start_pos: int
    block_table: list[int]


@dataclass
class PagedKernelMetadata:
    num_decode: int                      # rows [0, num_decode) are decode rows, one per sequence
    decode_block_tables: torch.Tensor    # [num_decode, width] int32
    decode_context_lens: torch.Tensor    # [num_decode] int32, including the new token
    max_decode_len: int
    prefill_block_tables: torch.Tensor   # [P, width] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, row offsets from row num_decode
    prefill_context_lens: torch.Tensor   # [P] int32, cached + new tokens
    max_prefill_len: int                 # longest chunk (new tokens)


def _tables(chunks: Sequence[ScheduledChunk], block_size: int, first_index: int = 0) -> torch.Tensor:
    """Block tables `[len(chunks), width]` int32, zero-padded; errors name item first_index + i."""
    needed = [-(-(c.start_pos + len(c.token_ids)) // block_size) for c in chunks]
    for index, (c, n) in enumerate(zip(chunks, needed), start=first_index):
        if len(c.block_table) < n:
            raise ValueError(f"build_paged_metadata: item {index} needs {n} blocks, its block_table has "
                             f"{len(c.block_table)}")
    width = max(needed, default=1)
    return torch.tensor([list(c.block_table[:n]) + [0] * (width - n) for c, n in zip(chunks, needed)],
                        dtype=torch.int32).reshape(len(chunks), width)


def _new_token_slots(chunks: Sequence[ScheduledChunk], tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of every new token of `chunks` (row order), from their block tables `[len(chunks), w]`."""
    if not chunks:
        return torch.empty(0, dtype=torch.long)
    positions = torch.cat([torch.arange(c.start_pos, c.start_pos + len(c.token_ids)) for c in chunks])
    rows = torch.cat([torch.full((len(c.token_ids),), i) for i, c in enumerate(chunks)])
    return tables.long()[rows, positions // block_size] * block_size + positions % block_size


def build_paged_metadata(chunks: Sequence[ScheduledChunk], num_decode: int, block_size: int,
                         device: torch.device | str) -> tuple[torch.Tensor, PagedKernelMetadata]:
    """chunks in row order (the first `num_decode` are decode items: one token, start_pos > 0).
    Returns (slot_mapping `[T]` int64, metadata), on `device`."""
    decode, prefill = chunks[:num_decode], chunks[num_decode:]
    if any(len(c.token_ids) != 1 or c.start_pos < 1 for c in decode):
        raise ValueError("build_paged_metadata: decode items need exactly one new token after a cached one")
    decode_tables, prefill_tables = _tables(decode, block_size), _tables(prefill, block_size, num_decode)
    slot_mapping = torch.cat([_new_token_slots(decode, decode_tables, block_size),
                              _new_token_slots(prefill, prefill_tables, block_size)])
    lengths = [c.start_pos + len(c.token_ids) for c in chunks]
    starts = [0]
    for c in prefill:
        starts.append(starts[-1] + len(c.token_ids))

    def on_device(values, dtype=torch.int32):
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta = PagedKernelMetadata(
        num_decode=num_decode,
        decode_block_tables=on_device(decode_tables),
        decode_context_lens=on_device(lengths[:num_decode]),
        max_decode_len=max(lengths[:num_decode], default=0),
        prefill_block_tables=on_device(prefill_tables),
        prefill_query_start_loc=on_device(starts),
        prefill_context_lens=on_device(lengths[num_decode:]),
        max_prefill_len=max((len(c.token_ids) for c in prefill), default=0),
    )
    return on_device(slot_mapping, torch.int64), meta


def paged_kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedKernelMetadata, scale: float) -> torch.Tensor:
    """Attention for the flat batch `q [T, H, D]` (its K/V already stored): the decode kernel over
    the decode rows, the prefill kernel over the rest."""
    outputs = []
    if meta.num_decode:
        outputs.append(paged_decode_attention(q[:meta.num_decode], k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale, max_context_len=meta.max_decode_len))
    if q.shape[0] > meta.num_decode:
        outputs.append(paged_prefill_attention(q[meta.num_decode:], k_cache, v_cache, meta.prefill_block_tables,
                                               meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
                                               max_query_len=meta.max_prefill_len))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

"""TritonAttention: the backend of the Triton kernels (engine/kernels/), the default on CUDA.

Row order: decode items (one new token each) first, in item order, then the prefill chunks.
`build_metadata` turns that into what the kernels read: the slot of every new token (for the
store_kv kernel), and per group the block tables (int32, padded with block 0, never read past a
sequence's length), context lengths and, for prefills, row offsets. The host also keeps the
longest decode context and the longest chunk, so the kernels' grids need no device sync.

The kernel modules import triton when they are imported; the selection (engine/attention/
__init__.py) imports this module only when this backend is chosen. Without CUDA the kernels run
in Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from nightshift.engine.attention.base import AttentionBackend, StepMetadata
from nightshift.engine.kernels.decode_attention import paged_decode_attention
from nightshift.engine.kernels.prefill_attention import paged_prefill_attention
from nightshift.engine.kernels.store_kv import store_kv as store_kv_kernel
from nightshift.engine.step import decode_indices


class ScheduledChunk(Protocol):          # engine.step.StepItem fits
    token_ids: list[int]
    start_pos: int
    block_table: list[int]


@dataclass
class TritonMetadata(StepMetadata):
    num_decode: int                      # rows [0, num_decode) are decode rows, one per sequence
    decode_block_tables: torch.Tensor    # [num_decode, width] int32
    decode_context_lens: torch.Tensor    # [num_decode] int32, including the new token
    max_decode_len: int
    prefill_block_tables: torch.Tensor   # [P, width] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, row offsets from row num_decode
    prefill_context_lens: torch.Tensor   # [P] int32, cached + new tokens
    max_prefill_len: int                 # longest chunk (new tokens)


def _tables(chunks: Sequence[ScheduledChunk], indices: list[int], block_size: int) -> torch.Tensor:
    """Block tables `[len(indices), width]` int32 of chunks[i] for i in indices, zero-padded."""
    needed = {i: -(-(chunks[i].start_pos + len(chunks[i].token_ids)) // block_size) for i in indices}
    for i in indices:
        if len(chunks[i].block_table) < needed[i]:
            raise ValueError(f"TritonAttention.build_metadata: item {i} needs {needed[i]} blocks, its block_table "
                             f"has {len(chunks[i].block_table)}")
    width = max(needed.values(), default=1)
    return torch.tensor([list(chunks[i].block_table[:needed[i]]) + [0] * (width - needed[i]) for i in indices],
                        dtype=torch.int32).reshape(len(indices), width)


def _new_token_slots(chunks: Sequence[ScheduledChunk], indices: list[int], tables: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Pool slot of every new token of chunks[i] for i in indices (in that order), from their block
    tables `[len(indices), w]`."""
    if not indices:
        return torch.empty(0, dtype=torch.long)
    positions = torch.cat([torch.arange(chunks[i].start_pos, chunks[i].start_pos + len(chunks[i].token_ids))
                           for i in indices])
    rows = torch.cat([torch.full((len(chunks[i].token_ids),), row) for row, i in enumerate(indices)])
    return tables.long()[rows, positions // block_size] * block_size + positions % block_size


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, config, block_size: int, dtype: torch.dtype, device: torch.device):
        if config.needs_masked_attention:
            raise ValueError(f"the Triton attention backend cannot serve {config.architecture!r}: its kernels have no "
                             f"sliding window (sliding_window={config.sliding_window}) or attention soft-capping "
                             f"(attn_logit_softcapping={config.attn_logit_softcapping}); "
                             "use attention_backend='torch' (or 'auto')")
        super().__init__(config, block_size, dtype, device)

    def build_metadata(self, items: Sequence[ScheduledChunk]) -> TritonMetadata:
        decode = decode_indices(items)
        decode_set = set(decode)
        prefill = [i for i in range(len(items)) if i not in decode_set]
        decode_tables = _tables(items, decode, self.block_size)
        prefill_tables = _tables(items, prefill, self.block_size)
        slot_mapping = torch.cat([_new_token_slots(items, decode, decode_tables, self.block_size),
                                  _new_token_slots(items, prefill, prefill_tables, self.block_size)])
        decode_lens = [items[i].start_pos + 1 for i in decode]
        prefill_lens = [items[i].start_pos + len(items[i].token_ids) for i in prefill]
        starts = [0]
        for i in prefill:
            starts.append(starts[-1] + len(items[i].token_ids))

        def on_device(values, dtype=torch.int32):
            return torch.as_tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return TritonMetadata(
            item_order=decode + prefill,
            slot_mapping=on_device(slot_mapping, torch.int64),
            num_decode=len(decode),
            decode_block_tables=on_device(decode_tables),
            decode_context_lens=on_device(decode_lens),
            max_decode_len=max(decode_lens, default=0),
            prefill_block_tables=on_device(prefill_tables),
            prefill_query_start_loc=on_device(starts),
            prefill_context_lens=on_device(prefill_lens),
            max_prefill_len=max((len(items[i].token_ids) for i in prefill), default=0),
        )

    def store_kv(self, k_cache, v_cache, k, v, meta: TritonMetadata) -> None:
        store_kv_kernel(k_cache, v_cache, k, v, meta.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        """The decode kernel over the decode rows, the prefill kernel over the rest. The kernels
        have no sliding window or soft-capping: those are refused (select_attention_backend does
        not pick this backend for such models)."""
        if window is not None or softcap is not None:
            raise ValueError(f"the Triton attention backend cannot apply a sliding window ({window}) or soft-capping "
                             f"({softcap}); use attention_backend='torch'")
        outputs = []
        if meta.num_decode:
            outputs.append(paged_decode_attention(q[:meta.num_decode], k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, scale, max_context_len=meta.max_decode_len))
        if q.shape[0] > meta.num_decode:
            outputs.append(paged_prefill_attention(q[meta.num_decode:], k_cache, v_cache, meta.prefill_block_tables,
                                                   meta.prefill_query_start_loc, meta.prefill_context_lens, scale,
                                                   max_query_len=meta.max_prefill_len))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

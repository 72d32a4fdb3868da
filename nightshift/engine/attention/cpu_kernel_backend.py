"""CpuKernelAttention: decode rows through the C kernel, prefill chunks through the torch path.

The C kernel (engine/kernels/cpu_paged_attention.py) reads each decode row's K/V in place through
its block table, so one call takes every decode row: no families, buckets or cascade prefix are
needed (shared blocks are simply read by each row). A prefill chunk's rows would each re-read the
whole context there, where SDPA over the gathered context reads it once for all of them, so
prefill chunks take the torch path (TorchAttention's spans; with a sliding window or soft-capping,
torch_paged.masked_attention, while the decode rows still take the kernel, which applies both). CPU
and float32 only; the selection (engine/attention/__init__.py) checks `cpu_paged_attention.supports`
first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from nightshift.engine.attention.base import (AttentionBackend, SequenceRows, StepMetadata, padded_block_tables,
                                              pool_slots, sequence_rows)
from nightshift.engine.attention.torch_backend import TorchAttention
from nightshift.engine.attention.torch_paged import (PrefillSpan, index_copy_kv, masked_attention,
                                                     prefill_spans_attention)
from nightshift.engine.kernels import cpu_paged_attention
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.step import StepItem, decode_indices


@dataclass
class KernelDecodeRows:
    """Decode rows [0, num_rows) of the flat batch, as the C kernel reads them."""
    num_rows: int
    block_tables: torch.Tensor              # [num_rows, width] int32, zero-padded
    context_lens: torch.Tensor              # [num_rows] int32, the new token included


@dataclass
class CpuKernelMetadata(StepMetadata):
    decode_rows: Optional[KernelDecodeRows] = None               # None: no decode rows this step
    prefills: list[PrefillSpan] = field(default_factory=list)   # after the decode rows, in row order
    # every row's sequence, for layers with a sliding window or soft-capping (None: model has none)
    sequences: Optional[list[SequenceRows]] = None


class CpuKernelAttention(AttentionBackend):
    name = "cpu-kernel"

    def __init__(self, config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__(config, block_size, dtype, device)
        self.prefill_path = TorchAttention(config, block_size, dtype, device)

    def build_metadata(self, items: Sequence[StepItem]) -> CpuKernelMetadata:
        decode = decode_indices(items)
        decode_set = set(decode)
        prefill = [i for i in range(len(items)) if i not in decode_set]
        meta = CpuKernelMetadata(item_order=decode + prefill, slot_mapping=torch.empty(0, dtype=torch.long))
        slot_parts = []
        if decode:
            tables = padded_block_tables([items[i].block_table for i in decode])
            positions = torch.tensor([items[i].start_pos for i in decode], dtype=torch.long)
            slot_parts.append(pool_slots(tables, positions[:, None], self.block_size).view(-1))
            meta.decode_rows = KernelDecodeRows(len(decode), tables.to(torch.int32), (positions + 1).to(torch.int32))
        meta.prefills, prefill_slots = self.prefill_path.prefill_spans(items, prefill, len(decode))
        meta.slot_mapping = torch.cat(slot_parts + prefill_slots).to(self.device)
        if self.config.needs_masked_attention:
            meta.sequences = sequence_rows(items, meta.item_order, self.block_size, self.device)
        return meta

    def store_kv(self, k_cache, v_cache, k, v, meta: CpuKernelMetadata) -> None:
        index_copy_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuKernelMetadata, scale: float,
                window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
        outputs = []
        rows = meta.decode_rows
        if rows is not None:
            outputs.append(cpu_paged_attention.paged_attention(q[:rows.num_rows], k_cache, v_cache, rows.block_tables,
                                                               rows.context_lens, scale, window=window, softcap=softcap))
        if window is not None or softcap is not None:   # prefill chunks: the masked torch path
            first = 0 if rows is None else rows.num_rows
            prefill = [s for s in meta.sequences if s.row_start >= first]
            if prefill:
                outputs.append(masked_attention(q, k_cache, v_cache, prefill, scale, window, softcap))
        else:
            outputs += prefill_spans_attention(q, k, v, k_cache, v_cache, meta.prefills, scale)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

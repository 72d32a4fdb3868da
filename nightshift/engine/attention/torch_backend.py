"""TorchAttention: the plain-torch backend (any device), K/V gathered from the pool per call.

Row order: decode items first, in families (sequences that share their first KV block, i.e. a
cached prompt prefix, together; the remaining ones in one family), each family sorted by
context length; then the prefill chunks in item order. Within a family, sequences whose context
lengths round up to the same multiple of `decode_bucket` share one masked attention call
(1 = only equal lengths share; larger buckets trade a little masked-out work for fewer per-op
calls). With `shared_prefix_attention`, a family's shared leading blocks are read once for all
of its sequences (cascade attention, torch_paged.decode_attention). Slots and masks are built
here once per step rather than once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from nightshift.engine.attention.base import (AttentionBackend, SequenceRows, StepMetadata, padded_block_tables,
                                              pool_slots, sequence_rows)
from nightshift.engine.attention.torch_paged import (DecodeBatch, DecodeGroup, PrefillSpan, decode_attention,
                                                     index_copy_kv, masked_attention, prefill_spans_attention)
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.step import StepItem, decode_indices


@dataclass
class TorchMetadata(StepMetadata):
    decode: list[DecodeBatch] = field(default_factory=list)     # rows first in the batch, in order
    prefills: list[PrefillSpan] = field(default_factory=list)   # then these, in row order
    # every row's sequence, for layers with a sliding window or soft-capping (None: model has none)
    sequences: Optional[list[SequenceRows]] = None


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                 decode_bucket: int = 64, shared_prefix_attention: bool = True):
        super().__init__(config, block_size, dtype, device)
        self.decode_bucket = max(1, decode_bucket)
        self.shared_prefix_attention = shared_prefix_attention

    # ---- metadata ----------------------------------------------------------------------
    def build_metadata(self, items: Sequence[StepItem]) -> TorchMetadata:
        families = self.decode_families(items)
        decode = [i for family in families for i in family]
        decode_set = set(decode)
        prefill = [i for i in range(len(items)) if i not in decode_set]
        meta = TorchMetadata(item_order=decode + prefill, slot_mapping=torch.empty(0, dtype=torch.long))
        slot_parts = []
        row = 0
        for family in families:
            batch, new_slots = self._decode_batch(items, family, row)
            meta.decode.append(batch)
            slot_parts.append(new_slots)
            row = batch.row_end
        meta.prefills, prefill_slots = self.prefill_spans(items, prefill, row)
        meta.slot_mapping = torch.cat(slot_parts + prefill_slots).to(self.device)
        if self.config.needs_masked_attention:
            meta.sequences = sequence_rows(items, meta.item_order, self.block_size, self.device)
        return meta

    def decode_families(self, items: Sequence[StepItem]) -> list[list[int]]:
        """Decode items (one new token, some context) grouped by their first KV block: sequences
        that share a cached prompt prefix share it. Singletons go together in one family; each
        family is sorted by context length."""
        decode = decode_indices(items)
        if not self.shared_prefix_attention:
            families = [decode] if decode else []
        else:
            by_first: dict[int, list[int]] = {}
            for i in decode:
                by_first.setdefault(items[i].block_table[0], []).append(i)
            families = [f for f in by_first.values() if len(f) > 1]
            singles = [f[0] for f in by_first.values() if len(f) == 1]
            if singles:
                families.append(singles)
        return [sorted(f, key=lambda i: items[i].start_pos) for f in families]

    def shared_prefix_blocks(self, decode_items: Sequence[StepItem]) -> int:
        """Leading blocks that every one of these decode sequences shares (same block ids), all
        strictly before each sequence's new token; 0 when cascade attention is off or for one sequence."""
        if not self.shared_prefix_attention or len(decode_items) < 2:
            return 0
        limit = min(it.start_pos for it in decode_items) // self.block_size
        first = decode_items[0].block_table
        count = 0
        while count < limit and all(it.block_table[count] == first[count] for it in decode_items):
            count += 1
        return count

    def prefill_spans(self, items: Sequence[StepItem], prefill: list[int],
                      first_row: int) -> tuple[list[PrefillSpan], list[torch.Tensor]]:
        """The spans of the prefill items `prefill` (rows from `first_row` on, in this order) and the
        slots their new tokens are written to."""
        spans, slot_parts = [], []
        row = first_row
        for i in prefill:
            item = items[i]
            n, start = len(item.token_ids), item.start_pos
            table = padded_block_tables([item.block_table])[0]
            context = pool_slots(table, torch.arange(start + n), self.block_size)
            slot_parts.append(context[start:])
            span = PrefillSpan(row, row + n, start, None, None)
            if start > 0:
                span.context_slots = context.to(self.device)
                span.mask = self._causal_mask(start, n).to(self.device)
            spans.append(span)
            row += n
        return spans, slot_parts

    def _decode_batch(self, items: Sequence[StepItem], family: list[int], row: int) -> tuple[DecodeBatch, torch.Tensor]:
        """Attention metadata of one decode family at rows [row, row + len(family)), and the slots
        its new tokens are written to."""
        device, block_size = self.device, self.block_size
        prefix_blocks = self.shared_prefix_blocks([items[i] for i in family])
        prefix_len = prefix_blocks * block_size
        batch = DecodeBatch(row, row + len(family), [])
        if prefix_blocks:
            table = torch.tensor(items[family[0]].block_table[:prefix_blocks], dtype=torch.long)
            batch.prefix_slots = pool_slots(table, torch.arange(prefix_len), block_size).to(device)
        new_slots = []
        start = 0
        for group in self._decode_groups(items, family):
            tables = padded_block_tables([items[i].block_table for i in group])
            lengths = torch.tensor([items[i].start_pos + 1 for i in group], dtype=torch.long)
            width = int(lengths.max()) - prefix_len
            offsets = torch.arange(prefix_len, prefix_len + width)
            slots = pool_slots(tables, offsets.expand(len(group), width), block_size)
            new_slots.append(slots[torch.arange(len(group)), lengths - 1 - prefix_len])
            mask = None
            if int(lengths.min()) - prefix_len != width:
                valid = offsets[None, :] < lengths[:, None]
                slots = torch.where(valid, slots, torch.zeros_like(slots))
                mask = torch.zeros(valid.shape, dtype=self.dtype).masked_fill_(~valid, float("-inf"))
                mask = mask[:, None, None, :].to(device)
            batch.groups.append(DecodeGroup(start, start + len(group), slots.to(device), mask))
            start += len(group)
        return batch, torch.cat(new_slots)

    def _decode_groups(self, items: Sequence[StepItem], family: list[int]) -> list[list[int]]:
        """A family's item indices (sorted by context length) split into length buckets."""
        groups: list[list[int]] = []
        current_key = None
        for i in family:
            key = (items[i].start_pos + 1 + self.decode_bucket - 1) // self.decode_bucket
            if key != current_key:
                groups.append([])
                current_key = key
            groups[-1].append(i)
        return groups

    def _causal_mask(self, start: int, n: int) -> torch.Tensor:
        """Additive mask for n new tokens after `start` cached ones, one row per (token, query head
        of a KV group)."""
        allowed = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        group = self.config.num_heads // self.config.num_kv_heads
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
        return mask.repeat_interleave(group, dim=0) if group > 1 else mask

    # ---- per layer -----------------------------------------------------------------------
    def store_kv(self, k_cache, v_cache, k, v, meta: TorchMetadata) -> None:
        index_copy_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float, window: Optional[int] = None,
                softcap: Optional[float] = None) -> torch.Tensor:
        if window is not None or softcap is not None:
            return masked_attention(q, k_cache, v_cache, meta.sequences, scale, window, softcap)
        outputs = [decode_attention(q[b.row_start:b.row_end], k_cache, v_cache, b, scale) for b in meta.decode]
        outputs += prefill_spans_attention(q, k, v, k_cache, v_cache, meta.prefills, scale)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

"""ModelRunner: owns the paged KV pool and runs one flat varlen batch through the model per step.

`execute(items)` takes every scheduled sequence's new tokens for this step, concatenates them
into one batch (decode items first, grouped by shared prefix and sorted by context length, then
prefill chunks), writes their
K/V into the pool by slot mapping, attends per sequence over its valid positions only, and
returns float32 logits for the last new token of each item that asks for them, in item order.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from nightshift.engine import cpu_attention
from nightshift.engine.attention import AttentionMetadata, DecodeBatch, DecodeGroup, KernelDecodeRows, PrefillSpan
from nightshift.engine.config import ModelConfig


@dataclass
class StepItem:
    token_ids: list[int]          # new tokens of this sequence to process this step
    start_pos: int                # tokens of this sequence already in the KV cache
    block_table: list[int]        # KV blocks of the sequence, in position order
    need_logits: bool = True      # return logits for the last new token


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, all layers, for one block of `block_size` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    """decode_bucket: decode sequences whose context lengths round up to the same multiple of
    this many tokens share one masked attention call (1 = only exactly equal lengths share;
    larger buckets trade a little masked-out work for fewer per-op calls).
    shared_prefix_attention: decode sequences that share leading KV blocks (prefix-cache hits on a
    common system prompt) attend to those blocks once for all of them (cascade attention).
    cpu_kernel: on CPU in float32, decode rows use the C paged-attention kernel
    (engine/cpu_attention.py) instead of gathered K/V, when it builds; decode_bucket and
    shared_prefix_attention then only concern the torch path it falls back to."""

    def __init__(self, model, num_kv_blocks: int, block_size: int = 16, decode_bucket: int = 64,
                 shared_prefix_attention: bool = True, attention_backend: str = "auto", cpu_kernel: bool = True):
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"num_kv_blocks ({num_kv_blocks}) and block_size ({block_size}) must be >= 1")
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {attention_backend!r}")
        self.model = model
        self.config: ModelConfig = model.config
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.embed_tokens.device
        # "triton": the kernels of engine/kernels/ read block tables directly (auto: on CUDA)
        self.attention_backend = attention_backend if attention_backend != "auto" else \
            ("triton" if self.device.type == "cuda" else "torch")
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.decode_bucket = max(1, decode_bucket)
        self.shared_prefix_attention = shared_prefix_attention
        self.cpu_kernel = cpu_kernel and self.attention_backend == "torch" and self.device.type == "cpu" and \
            cpu_attention.supports(self.dtype, self.config.num_heads, self.config.num_kv_heads, self.config.head_dim)
        shape = (num_kv_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.config.num_layers)]

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.block_size, self.dtype)

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """float32 logits `[number of items with need_logits, vocab_size]`, in item order."""
        if not items:
            raise ValueError("execute() needs at least one StepItem")
        for index, item in enumerate(items):
            self._check(index, item)
        if self.cpu_kernel:  # one kernel call takes every decode row: no families needed
            families = [rows] if (rows := _decode_indices(items)) else []
        else:
            families = self._decode_families(items)
        decode = [i for family in families for i in family]
        decode_set = set(decode)
        prefill = [i for i in range(len(items)) if i not in decode_set]

        token_ids: list[int] = []
        positions: list[int] = []
        last_row = {}
        for i in decode + prefill:
            item = items[i]
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
            last_row[i] = len(token_ids) - 1
        device = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)

        if self.attention_backend == "triton":
            from nightshift.engine.kernels.paged import build_paged_metadata
            slot_mapping, paged = build_paged_metadata([items[i] for i in decode + prefill], len(decode),
                                                       self.block_size, device)
            meta = AttentionMetadata(slot_mapping=slot_mapping, paged=paged)
        else:
            meta = self._torch_metadata(items, families, prefill)

        wanted = [last_row[i] for i, item in enumerate(items) if item.need_logits]
        logits_rows = torch.tensor(wanted, dtype=torch.long, device=device)
        logits = self.model(input_ids, pos, self.kv_caches, meta, logits_rows)
        return logits if wanted else torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=device)

    def _torch_metadata(self, items: list[StepItem], families: list[list[int]], prefill: list[int]) -> AttentionMetadata:
        """Metadata of the torch attention path (engine/attention.py): slots and masks per group."""
        device = self.device
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
        slot_parts = []
        row = 0
        if self.cpu_kernel:
            for decode in families:  # at most one: every decode row
                tables = self._block_tables([items[i].block_table for i in decode])
                positions = torch.tensor([items[i].start_pos for i in decode], dtype=torch.long)
                slot_parts.append(self._slots(tables, positions[:, None]).view(-1))
                meta.kernel_decode = KernelDecodeRows(len(decode), tables.to(torch.int32),
                                                      (positions + 1).to(torch.int32))
                row = len(decode)
        else:
            for family in families:
                batch, new_slots = self._decode_batch(items, family, row)
                meta.decode.append(batch)
                slot_parts.append(new_slots)
                row = batch.row_end
        for i in prefill:
            item = items[i]
            n, start = len(item.token_ids), item.start_pos
            table = self._block_tables([item.block_table])[0]
            context = self._slots(table, torch.arange(start + n))
            slot_parts.append(context[start:])
            span = PrefillSpan(row, row + n, start, None, None)
            if start > 0:
                span.context_slots = context.to(device)
                span.mask = self._causal_mask(start, n).to(device)
            meta.prefills.append(span)
            row += n
        meta.slot_mapping = torch.cat(slot_parts).to(device)
        return meta

    def _decode_families(self, items: list[StepItem]) -> list[list[int]]:
        """Decode items (one new token, some context) grouped by their first KV block: sequences
        that share a cached prompt prefix share it. Singletons go together in one family; each
        family is sorted by context length."""
        decode = _decode_indices(items)
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

    def _decode_batch(self, items: list[StepItem], family: list[int], row: int) -> tuple[DecodeBatch, torch.Tensor]:
        """Attention metadata of one decode family at rows [row, row + len(family)), and the slots
        its new tokens are written to."""
        device = self.device
        prefix_blocks = self._shared_prefix_blocks([items[i] for i in family])
        prefix_len = prefix_blocks * self.block_size
        batch = DecodeBatch(row, row + len(family), [])
        if prefix_blocks:
            table = torch.tensor(items[family[0]].block_table[:prefix_blocks], dtype=torch.long)
            batch.prefix_slots = self._slots(table, torch.arange(prefix_len)).to(device)
        new_slots = []
        start = 0
        for group in self._decode_groups(items, family):
            tables = self._block_tables([items[i].block_table for i in group])
            lengths = torch.tensor([items[i].start_pos + 1 for i in group], dtype=torch.long)
            width = int(lengths.max()) - prefix_len
            offsets = torch.arange(prefix_len, prefix_len + width)
            slots = self._slots(tables, offsets.expand(len(group), width))
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

    def _causal_mask(self, start: int, n: int) -> torch.Tensor:
        """Additive mask for n new tokens after `start` cached ones, one row per (token, query head
        of a KV group), built once per step rather than once per layer."""
        allowed = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        group = self.config.num_heads // self.config.num_kv_heads
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
        return mask.repeat_interleave(group, dim=0) if group > 1 else mask

    def _shared_prefix_blocks(self, decode_items: list[StepItem]) -> int:
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

    def _decode_groups(self, items: list[StepItem], decode: list[int]) -> list[list[int]]:
        """Decode item indices (sorted by context length) split into length buckets."""
        groups: list[list[int]] = []
        current_key = None
        for i in decode:
            key = (items[i].start_pos + 1 + self.decode_bucket - 1) // self.decode_bucket
            if key != current_key:
                groups.append([])
                current_key = key
            groups[-1].append(i)
        return groups

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots of `positions` given block tables (`tables` [B, nb] with positions [B, L],
        or one table [nb] with positions [L])."""
        blocks = torch.gather(tables, -1, positions // self.block_size)
        return blocks * self.block_size + positions % self.block_size

    def _check(self, index: int, item: StepItem) -> None:
        n = len(item.token_ids)
        end = item.start_pos + n
        where = f"StepItem {index}"
        if n == 0:
            raise ValueError(f"{where}: no new tokens")
        if item.start_pos < 0:
            raise ValueError(f"{where}: start_pos {item.start_pos} < 0")
        if end > self.max_model_len:
            raise ValueError(f"{where}: {end} tokens exceed the model's context of {self.max_model_len}")
        needed = (end + self.block_size - 1) // self.block_size
        if len(item.block_table) < needed:
            raise ValueError(f"{where}: {end} tokens need {needed} blocks, block_table has {len(item.block_table)}")
        bad = [b for b in item.block_table[:needed] if not 0 <= b < self.num_kv_blocks]
        if bad:
            raise ValueError(f"{where}: block ids {bad} outside the pool of {self.num_kv_blocks}")
        bad_tokens = [t for t in item.token_ids if not 0 <= t < self.config.vocab_size]
        if bad_tokens:
            raise ValueError(f"{where}: token ids {bad_tokens[:5]} outside the vocabulary of {self.config.vocab_size}")


def _decode_indices(items: list[StepItem]) -> list[int]:
    """Indices of the decode items: one new token after at least one cached one."""
    return [i for i, it in enumerate(items) if len(it.token_ids) == 1 and it.start_pos > 0]

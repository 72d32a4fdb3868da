"""ModelRunner: owns the paged KV pool and runs one flat varlen batch through the model per step.

`execute(items)` checks every scheduled sequence's new tokens for this step; a pure decode step
on CUDA is replayed from a CUDA graph (engine/cuda_graphs.py); otherwise it asks the attention
backend (chosen once, here, by engine/attention/__init__.py) for the step's metadata, concatenates
the tokens in the row order that metadata gives, runs the model (which writes the new K/V into the
pool and attends per sequence over its valid positions only), and returns float32 logits for the
last new token of each item that asks for them, in item order.
"""
from __future__ import annotations

import torch

from nightshift.engine.attention import AttentionOptions, select_attention_backend
from nightshift.engine.block_manager import RELEASED
from nightshift.engine.cpu_allocator import keep_large_allocations
from nightshift.engine.engine_config import DEFAULT_BLOCK_SIZE
from nightshift.engine.kv_cache import allocate_kv_caches, kv_bytes_per_block
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.step import StepItem

__all__ = ["ModelRunner", "StepItem"]


class ModelRunner:
    """attention_options: those of AttentionOptions (attention_backend, cpu_kernel, decode_bucket,
    shared_prefix_attention), which pick and configure `self.attention`. enforce_eager: no CUDA
    graphs (engine/cuda_graphs.py), which otherwise replay the decode steps on the Triton backend."""

    def __init__(self, model, num_kv_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, enforce_eager: bool = False,
                 **attention_options):
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"num_kv_blocks ({num_kv_blocks}) and block_size ({block_size}) must be >= 1")
        self.model = model
        self.config: ModelConfig = model.config
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.embed_tokens.device
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv_window = self.config.kv_window      # every layer's attention span, None: some layer is global
        self.attention = select_attention_backend(self.config, block_size, self.dtype, self.device,
                                                  AttentionOptions(**attention_options))
        self.kv_dtype: torch.dtype = model.kv_dtype      # the model's dtype, or narrower (LlamaForCausalLM.kv_dtype)
        self.kv_caches = allocate_kv_caches(self.config, num_kv_blocks, block_size, self.kv_dtype, self.device)
        if self.device.type == "cpu":
            keep_large_allocations()      # a step's big temporaries reused, not page-faulted anew
        self.graphs = None
        if self.device.type == "cuda" and self.attention.name == "triton" and not enforce_eager:
            from nightshift.engine.cuda_graphs import DecodeGraphs      # imports triton: CUDA only
            self.graphs = DecodeGraphs(model, self.attention, self.kv_caches, block_size, self.max_model_len)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.block_size, self.kv_dtype)

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def execute(self, items: list[StepItem], float_logits: bool = True) -> torch.Tensor:
        """float32 logits `[number of items with need_logits, vocab_size]`, in item order. With
        `float_logits` False (a step that needs only each row's argmax: sampler.plain_greedy), the
        logits as the LM head computes them where that is narrower (LlamaForCausalLM.project_logits:
        bfloat16 from the CPU's bf16 head, or a bfloat16 model's), each value exactly what float32
        would hold."""
        if not items:
            raise ValueError("execute() needs at least one StepItem")
        for index, item in enumerate(items):
            self._check(index, item)
        if self.graphs is not None and self.graphs.fits(items):
            return self.graphs.run(items)
        meta = self.attention.build_metadata(items)
        token_ids: list[int] = []
        positions: list[int] = []
        last_row = {}
        for i in meta.item_order:
            item = items[i]
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
            last_row[i] = len(token_ids) - 1
        device = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        wanted = [last_row[i] for i, item in enumerate(items) if item.need_logits]
        logits_rows = torch.tensor(wanted, dtype=torch.long, device=device)
        logits = self.model(input_ids, pos, self.kv_caches, self.attention, meta, logits_rows, float_logits)
        return logits if wanted else torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=device)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V of block `source` into block `destination`, every layer, for each pair
        (a forked choice's own copy of its prompt's partial last block)."""
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        destination = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, destination, k_cache.index_select(0, source))
            v_cache.index_copy_(0, destination, v_cache.index_select(0, source))

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
        # entries given back (BlockManager.RELEASED) only where no query of the item reads them:
        # wholly before the oldest position of its window, in a model whose every layer slides
        window = self.kv_window
        released = 0 if window is None else max(0, item.start_pos - window + 1) // self.block_size
        bad = [b for i, b in enumerate(item.block_table[:needed])
               if not 0 <= b < self.num_kv_blocks and not (b == RELEASED and i < released)]
        if bad:
            raise ValueError(f"{where}: block ids {bad} outside the pool of {self.num_kv_blocks}")
        bad_tokens = [t for t in item.token_ids if not 0 <= t < self.config.vocab_size]
        if bad_tokens:
            raise ValueError(f"{where}: token ids {bad_tokens[:5]} outside the vocabulary of {self.config.vocab_size}")

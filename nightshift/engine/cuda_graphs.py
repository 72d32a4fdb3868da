"""CUDA graphs of decode steps: one capture per (batch bucket, context bucket), replayed per step.

A decode step of a large model at a small batch is a few milliseconds of GPU work spread over
hundreds of kernel launches (per layer: norms, projections, RoPE, the KV store, attention), and
launching them from Python costs as much as running them. A graph replays the whole step with
one launch. What a step needs from the host travels in one copy from one pinned buffer.

* Only steps where every item is a decode row (one new token, some context) on the Triton
  backend are replayed; prefill and mixed steps run eagerly, as does everything with
  ``enforce_eager`` (EngineConfig).
* A graph is captured for a padded batch size (``BATCH_BUCKETS``) and a block-table width (a
  power of two of KV blocks, which also fixes the decode kernel's grid: a context bucket). Padding
  rows read block 0, write nothing (slot -1) and their logits are dropped.
* The step's token ids, positions, KV slots, context lengths and block tables are laid out in one
  int32 device buffer per capture (``_Layout``); the host fills the same layout in pinned memory
  and copies it with one asynchronous copy before the replay. The graph's inputs are views of
  that device buffer, its output a static ``[bucket, vocab]`` logits tensor.
* The first step of a new (batch, width) runs eagerly once (Triton compiles, the INT4 dispatcher
  measures its kernels: engine/quant/int4_dispatch.py), then is captured and replayed. Graphs
  share one memory pool.

Greedy tokens are the same with and without graphs (tests/engine/test_cuda_graphs.py, on a GPU):
a replay runs the eager step's kernels with the same launch parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from nightshift.engine.attention.triton_backend import TritonAttention, TritonMetadata
from nightshift.engine.step import StepItem, is_decode

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MIN_WIDTH = 8          # KV blocks: the smallest context bucket (128 tokens at block size 16)


def batch_bucket(batch: int) -> int | None:
    """The smallest bucket holding ``batch`` decode rows, or None past the largest."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def width_bucket(blocks: int) -> int:
    """The power of two >= blocks (at least MIN_WIDTH)."""
    return max(MIN_WIDTH, 1 << max(blocks - 1, 0).bit_length())


@dataclass(frozen=True)
class _Layout:
    """Offsets of one capture's inputs in the flat int32 buffer: ids, positions, slots and context
    lengths ([batch] each), then the block tables ([batch, width], row-major)."""
    batch: int
    width: int

    @property
    def size(self) -> int:
        return self.batch * (4 + self.width)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b = self.batch
        ids, positions, slots, lens = (flat[i * b:(i + 1) * b] for i in range(4))
        tables = flat[4 * b:self.size].view(b, self.width)
        return ids, positions, slots, lens, tables

    def fill(self, host: torch.Tensor, items: Sequence[StepItem], block_size: int) -> None:
        """Write the step's inputs (padding rows included) into ``host`` (pinned int32)."""
        ids, positions, slots, lens, tables = self.views(host)
        n = len(items)
        ids[:n] = torch.tensor([item.token_ids[0] for item in items], dtype=torch.int32)
        positions[:n] = torch.tensor([item.start_pos for item in items], dtype=torch.int32)
        slots[:n] = torch.tensor([item.block_table[item.start_pos // block_size] * block_size
                                  + item.start_pos % block_size for item in items], dtype=torch.int32)
        lens[:n] = positions[:n] + 1
        rows = [item.block_table[:item.start_pos // block_size + 1] for item in items]
        tables[:n] = torch.tensor([row + [0] * (self.width - len(row)) for row in rows], dtype=torch.int32)
        tables[n:] = 0
        ids[n:] = 0
        positions[n:] = 0
        slots[n:] = -1           # padding rows store no K/V
        lens[n:] = 1


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor     # [batch, vocab] float32, written by every replay


class DecodeGraphs:
    """The runner's captured decode steps. ``fits(items)`` says whether a step can be replayed,
    ``run(items)`` replays it (capturing first when its buckets are new) and returns the logits
    of the items that ask for them, in item order."""

    def __init__(self, model, attention: TritonAttention, kv_caches, block_size: int, max_model_len: int):
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = attention.device
        self.max_width = width_bucket(-(-max_model_len // block_size))
        largest = _Layout(BATCH_BUCKETS[-1], self.max_width).size
        self._host = torch.empty(largest, dtype=torch.int32, pin_memory=True)
        self._device = torch.zeros(largest, dtype=torch.int32, device=self.device)
        self._copied = torch.cuda.Event()
        self._graphs: dict[_Layout, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def fits(self, items: Sequence[StepItem]) -> bool:
        return (batch_bucket(len(items)) is not None and all(is_decode(item) for item in items)
                and self._layout(items).width <= self.max_width)

    def _layout(self, items: Sequence[StepItem]) -> _Layout:
        blocks = max(item.start_pos // self.block_size + 1 for item in items)
        return _Layout(batch_bucket(len(items)), width_bucket(blocks))

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch, width) of every graph captured so far."""
        return [(layout.batch, layout.width) for layout in self._graphs]

    def run(self, items: Sequence[StepItem]) -> torch.Tensor:
        layout = self._layout(items)
        self._copied.synchronize()           # the previous step's copy has left the pinned buffer
        layout.fill(self._host[:layout.size], items, self.block_size)
        self._device[:layout.size].copy_(self._host[:layout.size], non_blocking=True)
        self._copied.record()
        entry = self._graphs.get(layout)
        if entry is None:
            entry = self._graphs[layout] = self._capture(layout)
        entry.graph.replay()
        wanted = [i for i, item in enumerate(items) if item.need_logits]
        if len(wanted) == entry.logits.shape[0]:
            return entry.logits.clone()
        return entry.logits.index_select(0, torch.tensor(wanted, dtype=torch.long, device=self.device))

    def _forward(self, layout: _Layout) -> torch.Tensor:
        ids, positions, slots, lens, tables = layout.views(self._device)
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        meta = TritonMetadata(item_order=list(range(layout.batch)), slot_mapping=slots, num_decode=layout.batch,
                              decode_block_tables=tables, decode_context_lens=lens,
                              max_decode_len=layout.width * self.block_size,
                              prefill_block_tables=empty.view(0, 1), prefill_query_start_loc=empty,
                              prefill_context_lens=empty, max_prefill_len=0)
        return self.model(ids, positions, self.kv_caches, self.attention, meta, None)

    def _capture(self, layout: _Layout) -> _Graph:
        """An eager run of the step (compiles, measures the INT4 kernels; its K/V writes are the
        same the replay makes), then the capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(layout)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(layout)
        return _Graph(graph, logits)

"""Where a CPU engine run's time goes, and what its K/V reads alone cost: `python -m bench.engine
--breakdown` (bench/engine.py).

`KernelClock` times the run's calls into the CPU kernels' Python entry points (wall time inside
each call, summed per kind): the linear layers and LM head (`cpu_gemm.linear`; an LM head on a
GGUF's Q8_0 blocks, `Q8Head`, and an INT4 model's layers on our kernels, W4A8 or 4-bit x bf16,
apart), attention over each row's own positions
(`cpu_paged_attention`), a step's shared prefix on AMX tiles (`cpu_prefix_attention`), prefill
chunks as tiles (`cpu_prefill_attention`) and the fused layer's small ops (`cpu_fused_ops`). The
rest of the run is everything else: scheduling, sampling, Python, torch ops outside these kernels, and the small
steps an INT4 model runs in one C call per step (models/fused_cpu_stack.py).

`kv_read_bound` is a floor under the attention of the standard workload's decode steps: every
decode row reads the K and V of its own positions (those after the prefix all rows share, which
is read once per step and stays in cache), in every layer (up to a layer's window), every step.
At the rate this machine reads memory (`memory_read_rate`) those bytes alone take that long, when
a step's own K/V is larger than the CPU's caches (the standard workload's: 0.3-1.1 GB a step
for the default model). Beside the matmul floor it bounds the share of a run the matmuls can be
(issue 23's Deliver 3).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from nightshift.engine.kernels import cpu_fused_ops, cpu_paged_attention, cpu_prefill_attention, cpu_prefix_attention
from nightshift.engine.kv_cache import kv_bytes_per_block
from nightshift.engine.layers import cpu_gemm
from nightshift.engine.layers.q8_head import Q8Head
from nightshift.engine.layers.cpu_gemm import best_seconds
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.quant.cpu_w4_bf16 import W4Bf16Weight
from nightshift.engine.quant.cpu_w4a8 import W4A8Weight

# (module or class, entry point, what it is): every call the CPU path makes into these goes
# through the module's (or class's) attribute, so replacing the attribute times them all
ENTRY_POINTS = (
    (cpu_gemm, "linear", "linear layers and LM head"),
    (Q8Head, "linear", "LM head on Q8_0 blocks"),
    (Q8Head, "linear_int8", "LM head on Q8_0 blocks"),
    (W4A8Weight, "linear", "INT4 linear layers (W4A8)"),
    (W4Bf16Weight, "linear", "INT4 linear layers (4-bit x bf16)"),
    (cpu_paged_attention, "paged_attention", "attention, rows' own positions"),
    (cpu_paged_attention, "paged_attention_after_prefix", "attention, rows' own positions"),
    (cpu_prefix_attention, "prefix_attention", "attention, shared prefix (AMX)"),
    (cpu_prefill_attention, "prefill_attention", "attention, prefill chunks (tiles)"),
    (cpu_fused_ops, "add_rms_norm", "residual add + RMSNorm"),
    (cpu_fused_ops, "silu_mul", "SiLU/GeLU-and-mul"),
    (cpu_fused_ops, "gelu_tanh_mul", "SiLU/GeLU-and-mul"),
    (cpu_fused_ops, "rope_store", "RoPE + K/V store"),
    (cpu_fused_ops, "moe_combine", "MoE weighted sum"),
)


@dataclass
class KernelClock:
    """Seconds and calls per kind of kernel while `running()` is active."""
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def running(self) -> Iterator["KernelClock"]:
        originals = [(module, name, getattr(module, name)) for module, name, _ in ENTRY_POINTS]
        for (module, name, kind), (_, _, function) in zip(ENTRY_POINTS, originals):
            setattr(module, name, self._timed(function, kind))
        try:
            yield self
        finally:
            for module, name, function in originals:
                setattr(module, name, function)

    def _timed(self, function, kind: str):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
                self.calls[kind] = self.calls.get(kind, 0) + 1
        return timed

    def lines(self, run_seconds: float) -> list[str]:
        """The kinds, largest first, each with its share of the run, then the rest."""
        lines = [f"{kind:32s} {seconds:7.2f} s  {seconds / run_seconds:4.0%}  ({self.calls[kind]} calls)"
                 for kind, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])]
        rest = run_seconds - sum(self.seconds.values())
        return lines + [f"{'the rest':32s} {rest:7.2f} s  {rest / run_seconds:4.0%}  (scheduling, sampling, "
                        "Python, other torch ops, one-call small steps)"]


def memory_read_rate(nbytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """Bytes per second this machine reads from memory on the calling thread's torch threads: the
    best of `repeats` sums of a `nbytes` bfloat16 tensor (far larger than the caches)."""
    data = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    return nbytes / best_seconds(data.sum, repeats)


def shared_prefix_positions(prompts: list[list[int]], block_size: int) -> int:
    """The positions every prompt starts with, in whole blocks (what a step's rows share)."""
    first, shared = prompts[0], min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        shared = next((i for i in range(shared) if prompt[i] != first[i]), shared)
    return shared // block_size * block_size


def own_kv_positions(config: ModelConfig, prompt_lengths: list[int], output_len: int, shared: int) -> np.ndarray:
    """Positions of K/V each decode step of a run reads past the shared prefix, summed over its
    rows and layers, one entry per output token j (1 .. output_len - 1; token 0 comes from the
    prefill): the row of a prompt of length n attends n + j positions, in a layer with a window w
    only the last w of them, and the `shared` first ones are the prefix every row reads alike."""
    contexts = np.asarray(prompt_lengths, dtype=np.int64)[:, None] + np.arange(1, output_len, dtype=np.int64)
    own = np.zeros(contexts.shape, dtype=np.int64)
    for layer in range(config.num_layers):
        window = config.layer_window(layer)
        first = np.maximum(contexts - window, 0) if window else np.zeros_like(contexts)
        own += contexts - np.maximum(first, shared)
    return own.sum(axis=0)


@dataclass
class KvReadBound:
    bytes: int                # the decode steps' own K/V reads over the run
    step_bytes: int           # the largest step's (the last one)
    rate: float               # this machine's memory read rate, bytes/s
    shared: int               # positions of the shared prefix

    @property
    def seconds(self) -> float:
        return self.bytes / self.rate


def kv_read_bound(config: ModelConfig, kv_dtype: torch.dtype, prompts: list[list[int]], output_len: int,
                  block_size: int) -> KvReadBound:
    """The run's own K/V reads (`own_kv_positions` x the bytes of a position's K and V) and what
    they take at this machine's `memory_read_rate`."""
    per_position = kv_bytes_per_block(config, 1, kv_dtype) // config.num_layers     # one layer's K and V
    shared = shared_prefix_positions(prompts, block_size)
    steps = own_kv_positions(config, [len(p) for p in prompts], output_len, shared) * per_position
    return KvReadBound(int(steps.sum()), int(steps[-1]) if len(steps) else 0, memory_read_rate(), shared)

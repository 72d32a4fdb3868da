"""Which INT4 kernel runs a CUDA call: measured on first use per weight shape and step size.

The fastest way to multiply by an INT4 weight depends on the step's rows M (a batch-1 decode
reads the weight once and does almost no arithmetic; a 2k-token prefill is compute-bound), on
the weight's shape and on the GPU. So, as vLLM's and gemlite's autotuners do, the first call of
each (device, N, K, group, dtype, M bucket) times every candidate of engine/quant/triton_int4.py
on that shape (CUDA events, the L2 flushed before each run so the weight comes from memory as it
does in a model step) and keeps the fastest; later calls of the bucket run it directly.

M buckets are powers of two (a call runs the choice of the smallest bucket >= its M, timed at
that bucket's M). ``choices()`` lists what was chosen, for benchmarks and the worker's log.
Without CUDA (Triton's interpreter) nothing is timed: the first candidate runs.
"""
from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch

from nightshift.engine.quant.triton_int4 import KernelConfig, int4_matmul_with

Key = tuple[str, int, int, int, torch.dtype, int]

log = logging.getLogger(__name__)

_chosen: dict[Key, KernelConfig] = {}
_timings: dict[Key, list[tuple[float, KernelConfig]]] = {}
_flush: dict[torch.device, torch.Tensor] = {}


def m_bucket(m: int) -> int:
    """The power of two >= m (capped at 4096: larger steps are all compute-bound alike)."""
    return min(1 << max(m - 1, 0).bit_length(), 4096)


def candidates(m: int, group_size: int) -> list[KernelConfig]:
    """The configurations worth timing for a step of m rows (block_k divides the group)."""
    k_steps = [b for b in (32, 64, 128) if b <= group_size and group_size % b == 0]
    found: list[KernelConfig] = []
    if m == 1:
        bk = k_steps[-1]
        for block_n, split, warps in ((8, 4, 2), (16, 1, 4), (16, 2, 4), (16, 4, 4), (32, 1, 4),
                                      (32, 2, 4), (64, 1, 8), (8, 8, 2)):
            found.append(KernelConfig("gemv", block_m=1, block_n=block_n, block_k=bk, split_k=split,
                                      num_warps=warps, num_stages=1))
    if m <= 16:
        for bk in k_steps[-2:]:
            for block_n, split in ((32, 4), (64, 1), (64, 2), (64, 4), (128, 1), (128, 2)):
                found.append(KernelConfig("tiled", block_m=16, block_n=block_n, block_k=bk, split_k=split,
                                          num_warps=4, num_stages=4))
    elif m <= 128:
        bk = k_steps[-1]
        for block_m, block_n, split in ((32, 64, 1), (32, 128, 1), (64, 64, 1), (64, 128, 1), (32, 64, 2),
                                        (64, 64, 2)):
            if block_m <= max(m, 32):
                found.append(KernelConfig("tiled", block_m=block_m, block_n=block_n, block_k=bk, split_k=split,
                                          num_warps=4, num_stages=4))
    else:
        bk = k_steps[-1]
        for block_m, block_n, warps in ((64, 128, 4), (128, 128, 8), (128, 64, 4), (128, 256, 8)):
            found.append(KernelConfig("tiled", block_m=block_m, block_n=block_n, block_k=bk, split_k=1,
                                      num_warps=warps, num_stages=3))
    if m > 1:
        found.append(KernelConfig("dequant"))
    return found


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 7) -> float:
    """Median CUDA-event time of fn, the L2 flushed (a 256 MB write) before each run."""
    flush = _flush.get(device)
    if flush is None:
        flush = _flush[device] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)
    fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def choose(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           group_size: int) -> KernelConfig:
    """The configuration for a call of x's rows on this weight, measured once per bucket."""
    m, k = x.shape
    bucket = m_bucket(m)
    key: Key = (str(x.device), qweight.shape[0], k, group_size, x.dtype, bucket)
    config = _chosen.get(key)
    if config is not None:
        return config
    options = candidates(bucket, group_size)
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        # nothing to time on (the interpreter), or inside a CUDA-graph capture, where timing is
        # impossible: graphs are captured after an eager run of the same step (engine/cuda_graphs.py)
        return options[0]
    probe = torch.randn(bucket, k, device=x.device, dtype=x.dtype)
    timed = []
    for option in options:
        try:
            timed.append((_time_ms(lambda: int4_matmul_with(probe, qweight, scales, mins, group_size, option),
                                   x.device), option))
        except Exception as err:       # a configuration the GPU cannot run (e.g. out of shared memory)
            timed.append((float("inf"), option))
            log.warning("INT4 kernel %s failed on N=%d K=%d: %s", option.describe(), qweight.shape[0], k, err)
    timed.sort(key=lambda pair: pair[0])
    config = timed[0][1]
    _chosen[key] = config
    _timings[key] = timed
    return config


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight -> ``[M, N]`` in x's dtype, the measured fastest way."""
    return int4_matmul_with(x, qweight, scales, mins, group_size, choose(x, qweight, scales, mins, group_size))


def choices() -> dict[Key, KernelConfig]:
    """What was chosen so far, by (device, N, K, group, dtype, M bucket)."""
    return dict(_chosen)


def timings(key: Key) -> list[tuple[float, KernelConfig]]:
    """The candidates timed for a key (milliseconds, fastest first); empty where none were."""
    return list(_timings.get(key, []))

"""Which INT4 kernel runs a CUDA call: measured and checked on first use per weight shape and step size.

The fastest way to multiply by an INT4 weight depends on the step's rows M (a batch-1 decode
reads the weight once and does almost no arithmetic; a 2k-token prefill is compute-bound), on
the weight's shape and on the GPU. So, as vLLM's and gemlite's autotuners do, the first call of
each (device, N, K, group, dtype, M bucket) runs every candidate on that shape and keeps the
fastest; later calls of the bucket run it directly. The candidates: engine/quant/triton_int4.py's
GEMV, tensor-core tiles (the activation's tile as the dot's first operand, or swapped: the
weight's) and dequantize + cuBLAS, and torch's CUDA int4 kernel ("tinygemm",
``_weight_int4pack_mm``, bfloat16 only), which needs the weight in its own packed form.

* Timing: a CUDA graph of several runs, each after a write of 256 MB that flushes the L2 (so the
  weight comes from memory, as in a model step), minus a graph of the flushes alone: the GPU time
  of the kernels without Python's launch overhead, which the engine's CUDA graphs remove too
  (engine/cuda_graphs.py). Where a graph cannot be captured, CUDA events around each run.
* Checking: a candidate whose result on the probe differs from the dequantized weight's float32
  matmul by more than rounding (2e-2 of the largest value for 16-bit activations, 1e-3 for
  float32) is dropped with a warning, never chosen.
* Memory: a weight builds tinygemm's form only when it is timed or chosen; one whose timing did not
  choose it drops it again.

M buckets are powers of two (a call runs the choice of the smallest bucket >= its M, timed at
that bucket's M). ``choices()`` and ``timings()`` say what was chosen and why, for benchmarks.
Without CUDA (Triton's interpreter, in tests) nothing is timed: the first candidate runs.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from nightshift.engine.quant.cpu_kernels import tinygemm_scales_and_zeros
from nightshift.engine.quant.format import Int4Weight
from nightshift.engine.quant.triton_int4 import KernelConfig, int4_dequantize, int4_gemv, int4_swapped, int4_tiled

log = logging.getLogger(__name__)

Key = tuple[str, int, int, int, torch.dtype, int]

_chosen: dict[Key, KernelConfig] = {}
_timings: dict[Key, list[tuple[float, KernelConfig]]] = {}
_flush: dict[torch.device, torch.Tensor] = {}

TINYGEMM_GROUPS = (32, 64, 128, 256)


@dataclass(eq=False)
class KernelWeight(Int4Weight):
    """An INT4 weight on the GPU (engine/quant/format.py's packed ``qweight``, ``scales`` and
    ``mins``) and tinygemm's form of it, built on demand."""
    _tinygemm: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    @classmethod
    def of(cls, weight: Int4Weight) -> "KernelWeight":
        return cls(weight.qweight, weight.scales, weight.mins, weight.group_size)

    def tinygemm_form(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight, scales and zeros) for ``_weight_int4pack_mm``: its nibble order puts the
        even channel high; ``w = (q - 8) * scale + zero`` so ``zero = min + 8 * scale``."""
        if self._tinygemm is None:
            swapped = ((self.qweight & 0xF) << 4) | (self.qweight >> 4)
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), tiles)
            self._tinygemm = (packed, tinygemm_scales_and_zeros(self, torch.bfloat16))
        return self._tinygemm

    def drop_tinygemm_form(self) -> None:
        self._tinygemm = None


def tinygemm_applies(x: torch.Tensor, weight: KernelWeight) -> bool:
    """torch's CUDA int4 kernel: bfloat16 activations, its group sizes, K a multiple of 32 and N of 8."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and weight.group_size in TINYGEMM_GROUPS
            and weight.in_features % 32 == 0 and weight.out_features % 8 == 0)


def run_config(x: torch.Tensor, weight: KernelWeight, config: KernelConfig) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight the way ``config`` says -> ``[M, N]`` in x's dtype."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [M, {weight.in_features}], got {tuple(x.shape)}")
    args = (weight.qweight, weight.scales, weight.mins, weight.group_size)
    if config.method == "gemv":
        return int4_gemv(x, *args, config)
    if config.method == "tiled":
        return int4_tiled(x, *args, config)
    if config.method == "swapped":
        return int4_swapped(x, *args, config)
    if config.method == "dequant":
        return torch.mm(x, int4_dequantize(*args, x.dtype).t())
    packed, scales_and_zeros = weight.tinygemm_form()
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, weight.group_size, scales_and_zeros)


def m_bucket(m: int) -> int:
    """The power of two >= m (capped at 4096: larger steps are all compute-bound alike)."""
    return min(1 << max(m - 1, 0).bit_length(), 4096)


def key_of(x: torch.Tensor, weight: KernelWeight) -> Key:
    return (str(x.device), weight.out_features, weight.in_features, weight.group_size, x.dtype, m_bucket(x.shape[0]))


def candidates(m: int, group_size: int, tinygemm: bool = False) -> list[KernelConfig]:
    """The configurations worth timing for a step of m rows (block_k divides the group)."""
    k_steps = [b for b in (32, 64, 128) if b <= group_size and group_size % b == 0]
    found: list[KernelConfig] = []
    if m == 1:   # GEMV: block_k = channels per step (whole groups), several groups in flight per row
        for block_n, step, split, warps, stages in ((16, 512, 1, 4, 2), (16, 1024, 1, 4, 2), (8, 1024, 1, 2, 2),
                                                    (32, 512, 1, 4, 2), (32, 1024, 1, 8, 2), (16, 512, 2, 4, 2),
                                                    (8, 512, 4, 2, 2), (64, 256, 1, 8, 2), (16, 1024, 1, 4, 3),
                                                    (4, 1024, 1, 1, 2), (16, 256, 1, 4, 1)):
            found.append(KernelConfig("gemv", block_m=1, block_n=block_n, block_k=max(step, group_size),
                                      split_k=split, num_warps=warps, num_stages=stages))
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
    found += _swapped_candidates(m, k_steps[-1])
    if m > 1:
        found.append(KernelConfig("dequant"))
    if tinygemm and m <= 64:
        found.append(KernelConfig("tinygemm"))
    return found


def _swapped_candidates(m: int, block_k: int) -> list[KernelConfig]:
    """The swapped kernel's tiles for a step of m rows (the tensor cores' small dimension): 16 rows
    up to 16, 32-64 up to 128, 64-256 beyond, each with split-K where the (N, M) tiles alone are too
    few for the GPU's multiprocessors (a 4096-row weight makes 32 tiles of 128); the exact bias trick
    up to 16 rows (where it was the fastest on an H200), the weight dequantized in registers beyond
    (and both at 32-128). None at one row: the GEMV and tinygemm were faster on every 8B shape."""
    found: list[KernelConfig] = []

    def add(block_m: int, block_n: int, splits, warps: int, exact_forms) -> None:
        for split in splits:
            for exact in exact_forms:
                found.append(KernelConfig("swapped", block_m=block_m, block_n=block_n, block_k=block_k,
                                          split_k=split, num_warps=warps, num_stages=4 if m <= 16 else 3,
                                          exact=exact))

    if m == 1:
        return found
    if m <= 16:
        add(16, 64, (1, 4, 8), 4, (True,))
        add(16, 128, (2, 4), 4, (True,))
    elif m <= 128:
        for block_n in (64, 128):
            add(min(m, 64), block_n, (1, 2, 4), 4, (False, True))
    else:
        add(128, 128, (1, 2, 4), 8, (False,))
        add(256, 128, (1, 2), 8, (False,))
        add(64, 128, (1, 2), 4, (False,))
        add(128, 64, (2, 4), 4, (False,))
    return found


def _flush_buffer(device: torch.device) -> torch.Tensor:
    flush = _flush.get(device)
    if flush is None:
        flush = _flush[device] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)
    return flush


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """GPU milliseconds of one run of fn from a cold L2 (the module docstring says how)."""
    flush = _flush_buffer(device)
    fn()
    torch.cuda.synchronize(device)
    try:
        runs, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(runs):
            for _ in range(repeats):
                flush.zero_()
                fn()
        with torch.cuda.graph(flushes):
            for _ in range(repeats):
                flush.zero_()
        _replay_ms(runs), _replay_ms(flushes)        # warm replays
        with_runs = statistics.median(_replay_ms(runs) for _ in range(3))
        alone = statistics.median(_replay_ms(flushes) for _ in range(3))
        return max(with_runs - alone, 0.0) / repeats
    except RuntimeError as err:                        # no capture here: events around each run
        log.info("INT4 dispatch times without a CUDA graph (%s)", err)
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


def _error(y: torch.Tensor, reference: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def measure(weight: KernelWeight, options: list[KernelConfig], rows: int, dtype: torch.dtype,
            timer: Callable[[Callable[[], object]], float]) -> list[tuple[float, KernelConfig]]:
    """(time, option) of every option that computes a random ``[rows, K]`` probe correctly, fastest
    first; ``timer(fn)`` times one run of fn. Raises when none does."""
    probe = torch.randn(rows, weight.in_features, device=weight.qweight.device, dtype=dtype)
    args = (weight.qweight, weight.scales, weight.mins, weight.group_size)
    reference = probe.float() @ int4_dequantize(*args, torch.float32).t()
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2
    timed = []
    for option in options:
        try:
            error = _error(run_config(probe, weight, option), reference)
            if error > tolerance:
                log.warning("INT4 kernel %s dropped on N=%d K=%d: relative error %.3g", option.describe(),
                            weight.out_features, weight.in_features, error)
                continue
            timed.append((timer(lambda: run_config(probe, weight, option)), option))
        except Exception as err:  # noqa: BLE001 - a configuration this GPU cannot compile or run
            log.warning("INT4 kernel %s failed on N=%d K=%d: %s", option.describe(), weight.out_features,
                        weight.in_features, err)
    if not timed:
        raise RuntimeError(f"no INT4 kernel ran correctly on N={weight.out_features} K={weight.in_features} "
                           f"M={rows} {dtype}")
    return sorted(timed, key=lambda pair: pair[0])


def choose(x: torch.Tensor, weight: KernelWeight) -> KernelConfig:
    """The configuration for a call of x's rows on this weight, measured once per bucket."""
    key = key_of(x, weight)
    config = _chosen.get(key)
    if config is not None:
        return config
    bucket = key[-1]
    options = candidates(bucket, weight.group_size, tinygemm_applies(x, weight))
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        # nothing to time on (the interpreter), or inside a CUDA-graph capture, where timing is
        # impossible: graphs are captured after an eager run of the same step (engine/cuda_graphs.py)
        return options[0]
    timed = measure(weight, options, bucket, x.dtype, lambda fn: _time_ms(fn, x.device))
    config = timed[0][1]
    _chosen[key] = config
    _timings[key] = timed
    same_shape = [c for k, c in _chosen.items() if k[:5] == key[:5]]
    if not any(c.method == "tinygemm" for c in same_shape):
        weight.drop_tinygemm_form()
    return config


def int4_matmul(x: torch.Tensor, weight: KernelWeight) -> torch.Tensor:
    """``x [M, K]`` times the INT4 weight -> ``[M, N]`` in x's dtype, the measured fastest way."""
    return run_config(x, weight, choose(x, weight))


def choices() -> dict[Key, KernelConfig]:
    """What was chosen so far, by (device, N, K, group, dtype, M bucket)."""
    return dict(_chosen)


def timings(key: Key) -> list[tuple[float, KernelConfig]]:
    """The candidates timed for a key (milliseconds, fastest first); empty where none were."""
    return list(_timings.get(key, []))

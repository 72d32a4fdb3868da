"""Step-time benchmark of the ModelRunner alone (no scheduler): `python -m bench.runner`.

Decode: B sequences with one new token each, contexts of random length in [--min-len, --max-len],
all sharing --shared-blocks leading KV blocks (a common system prompt, as prefix-cache hits give);
timed on the CPU attention kernel (CpuKernelAttention, when the kernel builds) and on the torch
path (TorchAttention) with cascade (shared-prefix) attention on and off for several decode
buckets. Next to them, the "matmul floor": the same step's linear layers and lm_head alone on
random activations, the part of a step no attention or scheduling change can remove.
Prefill: one chunk of --chunk tokens over a cached prefix. Also times the load of the model.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch

from nightshift.engine.attention import CpuKernelAttention
from nightshift.engine.layers.cpu_gemm import best_seconds
from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.step import StepItem


def decode_items(batch: int, min_len: int, max_len: int, shared_blocks: int, block_size: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(batch)]
    next_block = shared_blocks
    items = []
    for length in lengths:
        own = (length + 1 + block_size - 1) // block_size - shared_blocks
        table = list(range(shared_blocks)) + list(range(next_block, next_block + own))
        next_block += own
        items.append(StepItem([rng.randrange(1000, 40000)], length, table, True))
    return items, next_block


def time_step(runner: ModelRunner, items, repeats: int) -> float:
    return best_seconds(lambda: runner.execute(items), repeats)


@torch.inference_mode()
def linear_rows(model, rows: int) -> list[tuple[torch.nn.Module, int]]:
    """Every linear layer of the decoder with the rows it multiplies in a step of `rows` tokens:
    all of them, except a mixture of experts' routed experts (models/moe.py: a block with
    `experts`, `top_k` and `num_experts`), each on its even share of the step's `rows * top_k`
    (token, expert) assignments."""
    share = {}
    for block in model.layers.modules():
        if isinstance(getattr(block, "experts", None), torch.nn.ModuleList) and hasattr(block, "top_k"):
            per_expert = max(1, math.ceil(rows * block.top_k / block.num_experts))
            share.update((id(m), per_expert) for m in block.experts.modules())
    return [(m, share.get(id(m), rows)) for m in model.layers.modules()
            if hasattr(m, "in_features") and not list(m.children())]


def matmul_floor(model, rows: int, repeats: int, lm_head: bool = True) -> float:
    """Seconds of one step's matmuls alone on `rows` rows: every linear layer of the decoder (a
    routed expert on its share of the rows: `linear_rows`), then (unless `lm_head` is False, as
    for prompt rows that need no logits) the LM head."""
    linears = linear_rows(model, rows)
    inputs = {(m.in_features, n): torch.randn(n, m.in_features, dtype=model.dtype) for m, n in linears}
    hidden = torch.randn(rows, model.config.hidden_size, dtype=model.dtype)

    def step():
        for m, n in linears:
            m(inputs[m.in_features, n])
        if lm_head:
            model.project_logits(hidden)
    return best_seconds(step, repeats)


def workload_matmul_seconds(model, logits_rows: int, other_rows: int, decode_rows: int, prefill_rows: int,
                            repeats: int = 3) -> float:
    """The matmul floor of a whole workload (CPU): `logits_rows` token rows that need the LM head
    (one per output token), timed at the rate of `decode_rows`-row steps, and `other_rows` that
    do not (the rest of the uncached prompt tokens), at the rate of `prefill_rows`-row steps
    without the LM head."""
    decode = matmul_floor(model, decode_rows, repeats) / decode_rows
    prefill = matmul_floor(model, prefill_rows, repeats, lm_head=False) / prefill_rows
    return logits_rows * decode + other_rows * prefill


@dataclass
class StepTiming:
    """The best time of one step: `rows` new tokens (decode sequences, or a prefill chunk)."""
    what: str                        # "matmul floor" | "cpu attention kernel" | "torch" | "prefill"
    rows: int
    seconds: float
    cascade: Optional[bool] = None   # torch path: shared-prefix (cascade) attention on
    bucket: Optional[int] = None     # torch path: decode_bucket
    cached: int = 0                  # prefill: tokens already in the cache before the chunk

    @property
    def tokens_per_second(self) -> float:
        return self.rows / self.seconds


def decode_timings(model, batch: int, min_len: int, max_len: int, shared_blocks: int, buckets: list[int],
                   repeats: int, block_size: int = 16) -> list[StepTiming]:
    """The matmul floor of a `batch`-row decode step, the step on the CPU attention kernel (where it
    builds), and on the torch path with cascade attention on and off for each decode bucket (one
    bucket only at batch 1, where buckets and cascade change nothing)."""
    items, blocks = decode_items(batch, min_len, max_len, shared_blocks, block_size)
    timings = [StepTiming("matmul floor", batch, matmul_floor(model, batch, repeats))]
    runner = ModelRunner(model, blocks + 1, block_size)
    if isinstance(runner.attention, CpuKernelAttention):
        timings.append(StepTiming("cpu attention kernel", batch, time_step(runner, items, repeats)))
    for cascade in (True, False):
        for bucket in buckets:
            runner = ModelRunner(model, blocks + 1, block_size, decode_bucket=bucket,
                                 shared_prefix_attention=cascade, cpu_kernel=False)
            timings.append(StepTiming("torch", batch, time_step(runner, items, repeats), cascade, bucket))
        if batch == 1:
            break
    return timings


def prefill_timing(model, shared_blocks: int, chunk: int, repeats: int, block_size: int = 16) -> StepTiming:
    """One chunk of `chunk` tokens after `shared_blocks` full blocks already in the cache."""
    runner = ModelRunner(model, (shared_blocks * block_size + chunk) // block_size + 2, block_size)
    cached = shared_blocks * block_size
    table = list(range(runner.num_kv_blocks))
    runner.execute([StepItem(list(range(1000, 1000 + cached)), 0, table, False)])
    item = StepItem(list(range(2000, 2000 + chunk)), cached, table, True)
    return StepTiming("prefill", chunk, time_step(runner, [item], repeats), cached=cached)


def describe(timing: StepTiming, min_len: int, max_len: int) -> str:
    t = timing
    step = f"{t.seconds * 1000:8.1f} ms/step  {t.tokens_per_second:7.1f} tok/s"
    if t.what == "matmul floor":
        return f"decode B={t.rows:3d} matmul floor (linears + lm_head only):      {step}"
    if t.what == "cpu attention kernel":
        return f"decode B={t.rows:3d} ctx {min_len}-{max_len} cpu attention kernel:     {step}"
    if t.what == "torch":
        return (f"decode B={t.rows:3d} ctx {min_len}-{max_len} torch cascade={'on ' if t.cascade else 'off'} "
                f"bucket={t.bucket:6d}: {step}")
    return (f"prefill chunk of {t.rows} over {t.cached} cached: {t.seconds * 1000:.1f} ms  "
            f"{t.tokens_per_second:.0f} tok/s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--min-len", type=int, default=220)
    parser.add_argument("--max-len", type=int, default=390)
    parser.add_argument("--shared-blocks", type=int, default=13)
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 64, 100000])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, model=None, log=print) -> list[StepTiming]:
    """Every timing of the command, each logged as it is measured; `model`: an already loaded one
    (default: load args.model)."""
    torch.set_num_threads(args.threads)
    if model is None:
        start = time.perf_counter()
        model = load_model(args.model, dtype=getattr(torch, args.dtype))
        log(f"model load {time.perf_counter() - start:.2f} s ({args.dtype}, {args.threads} threads, "
            f"cpu {torch.backends.cpu.get_cpu_capability()})")
    timings = []
    for batch in args.batch:
        for timing in decode_timings(model, batch, args.min_len, args.max_len, args.shared_blocks, args.buckets,
                                     args.repeats):
            log(describe(timing, args.min_len, args.max_len))
            timings.append(timing)
    timings.append(prefill_timing(model, args.shared_blocks, args.chunk, args.repeats))
    log(describe(timings[-1], args.min_len, args.max_len))
    return timings


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()

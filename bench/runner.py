"""Step-time benchmark of the ModelRunner alone (no scheduler): `python -m bench.runner`.

Decode: B sequences with one new token each, contexts of random length in [--min-len, --max-len],
all sharing --shared-blocks leading KV blocks (a common system prompt, as prefix-cache hits give);
timed on the CPU attention kernel (engine/cpu_attention.py, when it builds) and on the torch path
with cascade (shared-prefix) attention on and off for several decode buckets. Next to them, the
"matmul floor": the same step's linear layers and lm_head alone on random activations, the part of
a step no attention or scheduling change can remove.
Prefill: one chunk of --chunk tokens over a cached prefix. Also times the load of the model.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner, StepItem


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


def best_of(run, repeats: int) -> float:
    """Fastest of `repeats` timed calls of run(), after one warm-up call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def time_step(runner: ModelRunner, items, repeats: int) -> float:
    return best_of(lambda: runner.execute(items), repeats)


@torch.inference_mode()
def matmul_floor(model, rows: int, repeats: int, lm_head: bool = True) -> float:
    """Seconds of one step's matmuls alone on `rows` rows: every linear layer of the decoder,
    then (unless `lm_head` is False, as for prompt rows that need no logits) the LM head."""
    linears = [m for m in model.layers.modules() if hasattr(m, "in_features") and not list(m.children())]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=model.dtype) for m in linears}
    hidden = torch.randn(rows, model.config.hidden_size, dtype=model.dtype)

    def step():
        for m in linears:
            m(inputs[m.in_features])
        if lm_head:
            model.project_logits(hidden)
    return best_of(step, repeats)


def workload_matmul_seconds(model, logits_rows: int, other_rows: int, decode_rows: int, prefill_rows: int,
                            repeats: int = 3) -> float:
    """The matmul floor of a whole workload (CPU): `logits_rows` token rows that need the LM head
    (one per output token), timed at the rate of `decode_rows`-row steps, and `other_rows` that
    do not (the rest of the uncached prompt tokens), at the rate of `prefill_rows`-row steps
    without the LM head."""
    decode = matmul_floor(model, decode_rows, repeats) / decode_rows
    prefill = matmul_floor(model, prefill_rows, repeats, lm_head=False) / prefill_rows
    return logits_rows * decode + other_rows * prefill


def main(argv=None) -> None:
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    block_size = 16

    start = time.perf_counter()
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    print(f"model load {time.perf_counter() - start:.2f} s ({args.dtype}, {args.threads} threads, "
          f"cpu {torch.backends.cpu.get_cpu_capability()})")
    for batch in args.batch:
        items, blocks = decode_items(batch, args.min_len, args.max_len, args.shared_blocks, block_size)
        seconds = matmul_floor(model, batch, args.repeats)
        print(f"decode B={batch:3d} matmul floor (linears + lm_head only):      {seconds * 1000:8.1f} ms/step  "
              f"{batch / seconds:7.1f} tok/s")
        runner = ModelRunner(model, blocks + 1, block_size)
        if runner.cpu_kernel:
            seconds = time_step(runner, items, args.repeats)
            print(f"decode B={batch:3d} ctx {args.min_len}-{args.max_len} cpu attention kernel:     "
                  f"{seconds * 1000:8.1f} ms/step  {batch / seconds:7.1f} tok/s")
        for cascade in (True, False):
            for bucket in args.buckets:
                runner = ModelRunner(model, blocks + 1, block_size, decode_bucket=bucket,
                                     shared_prefix_attention=cascade, cpu_kernel=False)
                seconds = time_step(runner, items, args.repeats)
                print(f"decode B={batch:3d} ctx {args.min_len}-{args.max_len} torch cascade={'on ' if cascade else 'off'} "
                      f"bucket={bucket:6d}: {seconds * 1000:8.1f} ms/step  {batch / seconds:7.1f} tok/s")
            if batch == 1:
                break
    runner = ModelRunner(model, (args.shared_blocks * block_size + args.chunk) // block_size + 2, block_size)
    cached = args.shared_blocks * block_size
    table = list(range(runner.num_kv_blocks))
    runner.execute([StepItem(list(range(1000, 1000 + cached)), 0, table, False)])
    chunk = StepItem(list(range(2000, 2000 + args.chunk)), cached, table, True)
    seconds = time_step(runner, [chunk], args.repeats)
    print(f"prefill chunk of {args.chunk} over {cached} cached: {seconds * 1000:.1f} ms  "
          f"{args.chunk / seconds:.0f} tok/s")


if __name__ == "__main__":
    main()

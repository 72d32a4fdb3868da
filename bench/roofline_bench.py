"""`python -m bench.roofline_bench`: decode MBU and prefill MFU of the model runner.

Decode: `batch` sequences, each with `context` tokens in the KV cache, advance one token per step
through ModelRunner.execute (the engine's own step, metadata building included); the mean step
time over `--steps` steps gives output tok/s and MBU = (weight bytes + K/V bytes read) / step
time / peak bandwidth. The cached K/V are left as the pool's zeros: the bytes read, and so the
time, do not depend on their values.
Prefill: `--prefill-prompts` fresh prompts of `--prefill-len` tokens in one step; MFU = model
FLOPs (bench/roofline.py) / step time / peak dense bf16 FLOP/s.

Weights: the model of `--model`, or random weights of a named Llama shape (`--dummy-weights
llama-8b`). Peaks come from the device name on CUDA; elsewhere give --peak-bandwidth and
--peak-flops to get percentages.

    python -m bench.roofline_bench --dummy-weights llama-8b --quantization int4 --device cuda \\
        --batch-sizes 1,64,256 --context 512 --prefill-len 2048
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional

import torch

from bench.dummy_weights import build_dummy_model
from bench.roofline import (DevicePeak, decode_step_bytes, device_peak, kv_bytes_per_token, prefill_flops,
                             utilisation, weight_bytes_per_step)
from nightshift.engine.engine_config import resolve_device, resolve_dtype
from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.step import StepItem


@dataclass
class Measurement:
    label: str
    seconds: float          # per step
    tokens: int             # per step
    amount: float           # bytes (decode) or FLOPs (prefill) per step
    utilisation: Optional[float]

    def line(self, unit: str, kind: str) -> str:
        util = "n/a (no peak figures)" if self.utilisation is None else f"{self.utilisation:6.1%}"
        return (f"{self.label:<28} step {self.seconds * 1000:9.2f} ms   {self.tokens / self.seconds:10.1f} tok/s   "
                f"{self.amount / self.seconds / 1e9:9.1f} {unit}   {kind} {util}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(runner, items, repeats: int) -> float:
    """Mean seconds of runner.execute(items) over `repeats` calls, after one warm-up call."""
    runner.execute(items)
    _sync(runner.device)
    start = time.perf_counter()
    for _ in range(repeats):
        runner.execute(items)
    _sync(runner.device)
    return (time.perf_counter() - start) / repeats


def _block_tables(runner, sequences: int, tokens: int, what: str) -> list[list[int]]:
    """Disjoint block tables for `sequences` sequences of `tokens` tokens each, checked against the pool."""
    per_seq = (tokens + runner.block_size - 1) // runner.block_size
    if sequences * per_seq > runner.num_kv_blocks:
        raise ValueError(f"{what} needs {sequences * per_seq} KV blocks, the pool has {runner.num_kv_blocks}")
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(sequences)]


def _decode_items(runner, batch: int, context: int, seed: int = 0) -> list[StepItem]:
    """`batch` sequences whose new token is at position context - 1, on disjoint blocks."""
    tables = _block_tables(runner, batch, context, f"decode batch {batch} x context {context}")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, runner.config.vocab_size, (batch,), generator=g).tolist()
    return [StepItem([tokens[b]], context - 1, tables[b]) for b in range(batch)]


def measure_decode(runner, batch: int, context: int, steps: int, peak: Optional[DevicePeak],
                   seed: int = 0) -> Measurement:
    """One decode step of `batch` sequences whose new token is at position context - 1."""
    items = _decode_items(runner, batch, context, seed)
    seconds = _timed(runner, items, steps)
    amount = decode_step_bytes(weight_bytes_per_step(runner.model), kv_bytes_per_token(runner.config, runner.dtype),
                               [context] * batch)
    util = None if peak is None else utilisation(amount, seconds, peak.bandwidth)
    return Measurement(f"decode batch {batch} ctx {context}", seconds, batch, amount, util)


def measure_prefill(runner, prompts: int, length: int, repeats: int, peak: Optional[DevicePeak],
                    seed: int = 0) -> Measurement:
    """One step prefilling `prompts` fresh prompts of `length` tokens (logits for each last token)."""
    tables = _block_tables(runner, prompts, length, f"{prompts} prompts of {length} tokens")
    g = torch.Generator().manual_seed(seed)
    items = [StepItem(torch.randint(0, runner.config.vocab_size, (length,), generator=g).tolist(), 0, tables[p])
             for p in range(prompts)]
    seconds = _timed(runner, items, repeats)
    amount = prefill_flops(runner.config, [(0, length)] * prompts)
    util = None if peak is None else utilisation(amount, seconds, peak.bf16_flops)
    return Measurement(f"prefill {prompts} x {length}", seconds, prompts * length, amount, util)


def profile_decode(runner, batch: int, context: int, steps: int, rows: int = 14) -> str:
    """torch.profiler's table of the device kernels of `steps` decode steps (CUDA-graph replays
    included), by total device time: where a step's time goes, before tuning anything."""
    from torch.profiler import ProfilerActivity, profile
    items = _decode_items(runner, batch, context)
    runner.execute(items)
    _sync(runner.device)
    activities = [ProfilerActivity.CUDA] if runner.device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.execute(items)
        _sync(runner.device)
    key = "self_device_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    return (f"profile: decode batch {batch} ctx {context}, {steps} steps\n"
            + prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))


@dataclass
class RooflineReport:
    device: str
    peak: Optional[DevicePeak]
    weight_bytes: int                 # read per step
    kv_blocks: int
    decode: list[Measurement]         # one per batch size
    prefill: Optional[Measurement]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.roofline_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dummy-weights", metavar="NAME", help="random weights of a Llama shape "
                        "(llama-1b, llama-8b, llama-tiny) instead of --model")
    parser.add_argument("--quantization", choices=("none", "int4"), default="int4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the engine's)")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=512, help="tokens in the cache per decode sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-prompts", type=int, default=1)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-bandwidth", type=float, help="bytes/s (default: by CUDA device name)")
    parser.add_argument("--peak-flops", type=float, help="dense bf16 FLOP/s (default: by CUDA device name)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs of decode steps")
    parser.add_argument("--compare-eager", action="store_true",
                        help="CUDA: after the measurements, the decode batch sizes again without CUDA graphs")
    parser.add_argument("--profile", default="", metavar="BATCHES",
                        help="comma list of decode batch sizes to profile (torch.profiler kernel table)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> RooflineReport:
    """Load the model, measure every decode batch size and the prefill step, logging each line."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    quant = resolve_quant_config(args.quantization)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    max_len = max(args.context, args.prefill_len)
    t0 = time.time()
    if args.dummy_weights:
        model = build_dummy_model(args.dummy_weights, dtype, device, quant, max_position_embeddings=max_len)
    else:
        model = load_model(args.model, dtype=dtype, device=device, quant_config=quant)
    if max_len > model.config.max_position_embeddings:
        raise SystemExit(f"--context/--prefill-len {max_len} exceed the model's context "
                         f"{model.config.max_position_embeddings}")
    load_seconds = time.time() - t0
    blocks = max([b * -(-args.context // args.block_size) for b in batch_sizes] +
                 [args.prefill_prompts * -(-args.prefill_len // args.block_size)])
    runner = ModelRunner(model, num_kv_blocks=blocks, block_size=args.block_size, enforce_eager=args.enforce_eager)

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        peak = device_peak(name, args.peak_bandwidth, args.peak_flops)
    else:
        name = "CPU"
        peak = None if args.peak_bandwidth is None or args.peak_flops is None else \
            device_peak(name, args.peak_bandwidth, args.peak_flops)
    weights = weight_bytes_per_step(model)
    log(f"device: {name}" + ("" if peak is None else
                             f"  (peak {peak.bandwidth / 1e12:.2f} TB/s, {peak.bf16_flops / 1e12:.0f} TFLOP/s bf16)"))
    log(f"model: {model.config.name}  quantization={args.quantization}  dtype={dtype}  "
        f"weights read per step {weights / 2**30:.2f} GiB  load {load_seconds:.1f} s")
    log(f"KV pool: {blocks} blocks of {args.block_size}, {runner.kv_bytes_per_block * blocks / 2**30:.2f} GiB; "
        f"decode steps {'eager' if runner.graphs is None else 'replayed from CUDA graphs'}")
    report = RooflineReport(name, peak, weights, blocks, [], None)
    for batch in batch_sizes:
        report.decode.append(measure_decode(runner, batch, args.context, args.steps, peak))
        log(report.decode[-1].line("GB/s", "MBU"))
    if args.prefill_len > 0:
        report.prefill = measure_prefill(runner, args.prefill_prompts, args.prefill_len, args.prefill_repeats, peak)
        log(report.prefill.line("GFLOP/s", "MFU"))
    for batch in [int(b) for b in args.profile.split(",") if b]:
        log(profile_decode(runner, batch, args.context, min(args.steps, 10)))
    if args.compare_eager and runner.graphs is not None:
        del runner                        # its KV pool freed first: the eager runner gets its own
        eager = ModelRunner(model, num_kv_blocks=blocks, block_size=args.block_size, enforce_eager=True)
        for batch in batch_sizes:
            log(measure_decode(eager, batch, args.context, args.steps, peak).line("GB/s", "MBU") + "  (eager)")
    return report


def main(argv=None) -> None:
    run(parse_args(argv), log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()

"""`python -m bench.engine`: one fixed synthetic workload through our engine and HF generate().

Workload: N requests (default 256), each one shared ~200-token system prompt plus a unique
20-60-token user turn, through the model's chat template (the shape of a batch job: one
instruction, many inputs, so the prefix cache matters as much as raw speed); O output tokens
each (default 128), EOS ignored, greedy. Our engine runs them all in one offline
generate() call. The baseline is transformers' generate() on the same weights and
machine in the same run: left-padded static batches, greedy, the same output length,
at each batch size of --hf-batch-sizes; the best output tok/s is the one compared.

Prints output tok/s, total tok/s, TTFT and TPOT p50/p95/p99, prefix-hit rate, and the
ratio to HF. --quick is a small version that finishes in about a minute.
On CPU it also prints the run's matmul floor: how long the linear layers and LM head alone take
on the token rows the run computed (bench/runner.py), the part of the run no attention,
scheduling or kernel change outside the GEMMs can remove; with the HF baseline, next to the time
5x the best HF throughput would allow. --breakdown (CPU) adds where the run's time went, per kind
of CPU kernel, and the seconds its decode steps' own K/V reads alone take at this machine's memory
read rate, with the share of the run the matmul floor could at most be beside them (bench/cpu_time.py).
On CUDA (--device, default auto) it also prints decode MBU and prefill MFU of the engine's runner
(bench/roofline_bench.py; on CPU only with --peak-bandwidth/--peak-flops). --dummy-weights NAME
runs random weights in both our engine and the HF baseline: a Llama shape (llama-1b, llama-8b;
bench/dummy_weights.py), or another family's small realistic layout (qwen3-small, gemma2-small,
gemma3-small, phi3-small, olmoe-small, mixtral-small, qwen3-moe-small, qwen2-moe-small;
bench/random_hf_models.py), written for the run as a Hugging Face folder into a temporary
directory and run as `--model FOLDER` would be (HF's side: transformers' own class of it).

--structured runs the same workload a second time in the same process with a JSON schema on
every request (STRUCTURED_SCHEMA: an extraction object whose summary is long enough that every
answer runs to the output length, so both runs make the same tokens) and prints the constrained
run's output tok/s against the unconstrained one's: what grammar masks cost (engine/grammar.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from bench import random_hf_models
from bench.cpu_time import KernelClock, KvReadBound, kv_read_bound
from bench.dummy_weights import DUMMY_SHAPES, DummyCheckpoint, dummy_engine
from bench.peers import PeerResult, available, ct2_results, llamacpp_results, parse_peers, token_text
from bench.peers import describe as describe_peer
from bench.roofline import DevicePeak, device_peak
from bench.roofline_bench import Measurement, measure_decode, measure_prefill
from bench.runner import workload_matmul_seconds
from nightshift.engine.engine import Engine
from nightshift.engine.engine_config import resolve_device
from nightshift.engine.loader import load_checkpoint
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams, StructuredOutput

WORDS = ("river mountain quiet lantern copper orchard signal harbor violet meadow engine pocket "
         "thunder ladder marble garden crystal window shadow compass feather canvas silver rocket "
         "planet bridge candle forest ocean desert winter summer market museum island castle "
         "dragon puzzle theory number letter station violin tunnel glacier comet pepper saddle").split()

SYSTEM_SENTENCES = [
    "You are a helpful, patient and precise assistant working for a small research library.",
    "Answer every question in plain language and keep each answer short unless asked for detail.",
    "When a question is ambiguous, say which interpretation you chose before you answer it.",
    "Never invent citations, quotations, numbers or names; say so when you do not know something.",
    "Prefer concrete examples over abstract explanations, and give units for every quantity.",
    "If the user asks for code, write small, readable functions with a one-line docstring each.",
    "If the user asks for a list, keep it to at most five items and order them by importance.",
    "Be polite but do not apologise more than once, and never repeat the question back to the user.",
    "You may use simple Markdown for lists and code, but no tables and no headings.",
    "Assume the reader is a curious adult without special training in the subject.",
    "When you are unsure, give your best estimate together with how confident you are in it.",
    "End every answer with a single sentence that suggests a sensible next question to ask.",
]


def system_prompt(tokenizer, system_tokens: int = 200) -> str:
    """The workload's shared system prompt: its sentences up to ~system_tokens tokens."""
    system = ""
    for sentence in SYSTEM_SENTENCES * 4:
        if len(tokenizer.encode(system)) >= system_tokens:
            break
        system = f"{system} {sentence}".strip()
    return system


def build_workload(tokenizer, num_requests: int, seed: int = 0,
                   system_tokens: int = 200, user_tokens: tuple[int, int] = (20, 60)) -> list[list[int]]:
    """Prompt token ids: one shared system prompt (~system_tokens) + a unique user turn each."""
    rng = random.Random(seed)
    system = system_prompt(tokenizer, system_tokens)
    prompts = []
    for i in range(num_requests):
        target = rng.randint(*user_tokens)
        words = [f"Request {i}:"]
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        user = " ".join(words)
        prompts.append(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": user}]))
    return prompts


def percentiles(values) -> str:
    if not len(values):
        return "n/a"
    p50, p95, p99 = np.percentile(np.asarray(values, dtype=float) * 1000, [50, 95, 99])
    return f"p50 {p50:8.1f} ms   p95 {p95:8.1f} ms   p99 {p99:8.1f} ms"


@dataclass
class EngineResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft: list[float]
    tpot: list[float]
    steps: int
    preemptions: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


# The --structured run's schema: an extraction answer whose summary (at least 2,000 characters)
# keeps every answer going past the benchmark's output length.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "language": {"enum": ["en", "de", "fr", "es", "other"]},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 5},
        "year": {"type": ["integer", "null"], "minimum": 1900, "maximum": 2100},
        "summary": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "language", "sentiment", "topics", "year", "summary"],
    "additionalProperties": False,
}


def run_engine(engine, prompts: list[list[int]], output_len: int,
               structured: Optional[StructuredOutput] = None) -> EngineResult:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, structured=structured)
    requests = [GenerationRequest(f"req-{i}", p, params) for i, p in enumerate(prompts)]
    before = engine.stats()
    start = time.time()
    outputs = list(engine.generate(requests, offline=True))
    seconds = time.time() - start
    after = engine.stats()
    errors = [o for o in outputs if o.finish_reason == "error"]
    if errors:
        raise SystemExit(f"engine rejected {len(errors)} requests, first: {errors[0].error}")
    ttft = [o.first_token_time - start for o in outputs]
    tpot = [(o.finish_time - o.first_token_time) / (o.completion_tokens - 1) for o in outputs
            if o.completion_tokens > 1]
    return EngineResult(seconds, sum(o.prompt_tokens for o in outputs), sum(o.completion_tokens for o in outputs),
                        sum(o.cached_prompt_tokens for o in outputs), ttft, tpot,
                        after.num_steps - before.num_steps, after.num_preemptions - before.num_preemptions)


def structured_comparison(engine, prompts: list[list[int]], output_len: int, plain: EngineResult, repeats: int,
                          log) -> tuple[EngineResult, EngineResult]:
    """The workload with STRUCTURED_SCHEMA on every request against the unconstrained run, each
    from an empty prefix cache, alternating `repeats` times (single runs on a 2-core machine vary
    by several percent); the best run of each side is compared. Returns (constrained, plain) bests."""
    structured = StructuredOutput("json_schema", STRUCTURED_SCHEMA, "bench")
    run_engine(engine, prompts[:2], 2, structured)  # warm-up: the tokenizer view and the schema
    plains, constrained = [plain], []
    for round_ in range(repeats):
        engine.reset_prefix_cache()
        constrained.append(run_engine(engine, prompts, output_len, structured))
        if round_ + 1 < repeats:
            engine.reset_prefix_cache()
            plains.append(run_engine(engine, prompts, output_len))
    best, best_plain = max(constrained, key=lambda r: r.output_tps), max(plains, key=lambda r: r.output_tps)
    log("\n== nightshift engine, a JSON schema on every request (grammar masks) ==")
    log(f"time {best.seconds:.1f} s   steps {best.steps}   output tokens {best.output_tokens} "
        f"(unconstrained {best_plain.output_tokens})")
    log(f"output tok/s, runs alternating: unconstrained {', '.join(f'{r.output_tps:.1f}' for r in plains)}; "
        f"constrained {', '.join(f'{r.output_tps:.1f}' for r in constrained)}")
    log(f"output tok/s {best.output_tps:9.1f}   = {best.output_tps / best_plain.output_tps:.1%} of the "
        f"unconstrained run's {best_plain.output_tps:.1f} (best of each)")
    return best, best_plain


def hf_model_from_cache(model: str, dtype: torch.dtype):
    """transformers' LlamaForCausalLM on the same float32 weights our loader cached."""
    return hf_model_from_checkpoint(load_checkpoint(model), dtype)


def hf_model_from_checkpoint(checkpoint, dtype: torch.dtype, device: str = "cpu"):
    """transformers' LlamaForCausalLM on a checkpoint's weights (ours, or bench.dummy_weights')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = checkpoint.config
    if c.architecture != "llama":
        raise SystemExit(f"the HF baseline here supports llama checkpoints, not {c.architecture!r}")
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                         tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
                         eos_token_id=c.eos_token_ids[0] if c.eos_token_ids else None)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    state = {name: checkpoint.tensor(name) for name in checkpoint.names()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(state, strict=False, assign=True)
    if c.tie_word_embeddings:
        hf.tie_weights()
    missing = [n for n, p in hf.named_parameters() if p.is_meta]
    if missing:
        raise SystemExit(f"HF baseline: weights missing from the checkpoint: {missing[:5]}")
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # buffers were created on meta
    return hf.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def run_hf(hf, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int) -> tuple[float, int, int]:
    """Left-padded static batches over `prompts`; returns (seconds, output tokens, prompt tokens)."""
    device = next(hf.parameters()).device
    start = time.time()
    produced = 0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
        produced += (out.shape[1] - width) * len(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() - start, produced, sum(len(p) for p in prompts)


@dataclass
class MatmulFloor:
    """Seconds the run's matmuls alone would take (bench/runner.py's matmul floor at the engine's
    step size, over the token rows the run computed)."""
    seconds: float
    logits_rows: int          # rows that need the LM head (one per output token)
    other_rows: int           # the other uncached prompt rows
    decode_rows: int          # the step size the logits rows are timed at (a full decode step)
    prefill_rows: int         # the step size the other rows are timed at (a full prefill step)


def matmul_floor(engine, result: EngineResult, num_requests: int) -> Optional[MatmulFloor]:
    """On CPU, the run's matmul floor; None elsewhere (the floor is timed without device syncs)."""
    if engine.runner.device.type != "cpu":
        return None
    uncached = result.prompt_tokens - result.cached_tokens
    logits_rows, other_rows = result.output_tokens, max(0, uncached - num_requests)
    decode_rows = min(engine.config.max_num_seqs, num_requests)
    prefill_rows = max(1, min(engine.config.max_num_batched_tokens, other_rows))
    seconds = workload_matmul_seconds(engine.runner.model, logits_rows, other_rows, decode_rows, prefill_rows)
    return MatmulFloor(seconds, logits_rows, other_rows, decode_rows, prefill_rows)


@dataclass
class Roofline:
    device: str
    peak: DevicePeak
    decode: Measurement
    prefill: Measurement


def roofline(engine, args, prompt_len: int, output_len: int, num_requests: int) -> Optional[Roofline]:
    """Decode MBU and prefill MFU of the engine's own runner (bench/roofline_bench.py): decode at
    the workload's batch (as many sequences as the KV pool holds) and mid-generation context,
    prefill of one --roofline-prefill-len prompt; None on CPU without explicit peaks. Runs after
    the workload: it overwrites KV blocks."""
    runner = engine.runner
    if runner.device.type == "cuda":
        name = torch.cuda.get_device_name(runner.device)
    elif args.peak_bandwidth is None or args.peak_flops is None:
        return None
    else:
        name = "CPU"
    peak = device_peak(name, args.peak_bandwidth, args.peak_flops)
    context = prompt_len + output_len // 2
    per_seq = -(-context // runner.block_size)
    batch = max(1, min(num_requests, engine.config.max_num_seqs, runner.num_kv_blocks // per_seq))
    prefill = min(args.roofline_prefill_len, runner.max_model_len, runner.num_kv_blocks * runner.block_size)
    return Roofline(name, peak, measure_decode(runner, batch, context, 10, peak),
                    measure_prefill(runner, 1, prefill, 3, peak))


@dataclass
class BenchReport:
    model_name: str
    kv_blocks: int
    prompt_lengths: list[int]
    output_len: int
    engine: EngineResult
    structured: Optional[EngineResult] = None           # --structured
    roofline: Optional[Roofline] = None
    floor: Optional[MatmulFloor] = None
    breakdown: Optional[KvReadBound] = None                  # --breakdown on CPU
    peers: list[PeerResult] = field(default_factory=list)     # every peer at every batch size; none with --skip-hf

    @property
    def best_peer(self) -> Optional[PeerResult]:
        return max(self.peers, key=lambda r: r.output_tps, default=None)

    @property
    def ratio(self) -> Optional[float]:
        """Engine output tok/s over the fastest peer's (its best batch size)."""
        best = self.best_peer
        return None if best is None else self.engine.output_tps / best.output_tps


def breakdown(engine, clock: KernelClock, result: EngineResult, floor: Optional[MatmulFloor],
              prompts: list[list[int]], output_len: int, log) -> KvReadBound:
    """--breakdown: the run's time per kind of CPU kernel, and the floor its K/V reads put under it."""
    log("\n== where the run's time went (wall time inside the CPU kernels' calls) ==")
    for line in clock.lines(result.seconds):
        log(line)
    runner = engine.runner
    bound = kv_read_bound(runner.config, runner.kv_dtype, prompts, output_len, engine.config.block_size)
    log(f"K/V reads: the decode steps read {bound.bytes / 1e9:.1f} GB of their rows' own K/V (after the "
        f"{bound.shared} shared positions; {bound.step_bytes / 1e6:.0f} MB in the last step); at this machine's "
        f"{bound.rate / 1e9:.1f} GB/s read rate that is >= {bound.seconds:.1f} s where a step's K/V outgrows the caches")
    if floor is not None:
        log(f"so the matmul floor can be at most {floor.seconds / (floor.seconds + bound.seconds):.0%} of such a run "
            f"({floor.seconds:.1f} s of matmuls, {bound.seconds:.1f} s of K/V reads, nothing else)")
    return bound


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"


DUMMY_MAX_POSITIONS = 8192   # context of --dummy-weights models (the workload needs < 400 tokens)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dummy-weights", metavar="NAME", choices=[*DUMMY_SHAPES, *random_hf_models.SHAPES],
                        help="random weights instead of --model, the default tokenizer: a Llama shape ("
                             f"{', '.join(DUMMY_SHAPES)}; bench/dummy_weights.py) or another family's layout "
                             f"({', '.join(random_hf_models.SHAPES)}; bench/random_hf_models.py, written to a "
                             "temporary Hugging Face folder for the run)")
    parser.add_argument("--tokenizer", default="default", help="with --dummy-weights: the tokenizer's model, or "
                        "a directory written by Tokenizer.save (default: the default model's)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (engine and HF baseline)")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size (default: the engine's)")
    parser.add_argument("--roofline-prefill-len", type=int, default=2048, help="prompt length of the MFU step")
    parser.add_argument("--peak-bandwidth", type=float, help="bytes/s for MBU (default: by CUDA device name)")
    parser.add_argument("--peak-flops", type=float, help="dense bf16 FLOP/s for MFU (default: by CUDA device name)")
    parser.add_argument("--quick", action="store_true", help="small workload, about a minute in all")
    parser.add_argument("--num-requests", type=int, help="requests (default 256; --quick 32)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default 128; --quick 32)")
    parser.add_argument("--quantization", choices=("none", "int4"), default="none")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="engine dtype (default: the engine's default)")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs of decode steps")
    parser.add_argument("--hf-batch-sizes", default=None, help="comma list (default 1,8,32,64; --quick 1,8,32)")
    parser.add_argument("--hf-requests", type=int, default=None,
                        help="requests per HF batch size (default: one batch of that size; at least one)")
    parser.add_argument("--skip-hf", action="store_true", help="only our engine (no peers)")
    parser.add_argument("--peers", default=None,
                        help="comma list of the systems to compare with (bench/peers.py): hf (float32 and bfloat16), "
                             "hf-float32, hf-bfloat16, ct2 (CTranslate2, the bench extra), llamacpp (where "
                             "llama-cpp-python is installed); default: hf-<--hf-dtype>")
    parser.add_argument("--structured", action="store_true",
                        help="also run the workload with a JSON schema on every request and compare")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--structured: runs of each side, alternating; the best of each is compared (default 2)")
    parser.add_argument("--breakdown", action="store_true",
                        help="CPU: time the run's calls into each kind of CPU kernel, and what its K/V reads alone "
                             "take at this machine's memory read rate (bench/cpu_time.py)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> BenchReport:
    """The whole benchmark; each section is logged as soon as it is measured. A --dummy-weights
    family of bench/random_hf_models.py is written to a temporary folder, run as --model, and
    removed after."""
    if args.dummy_weights not in random_hf_models.SHAPES:
        return _run(args, log)
    with tempfile.TemporaryDirectory(prefix=f"nightshift-{args.dummy_weights}-") as tmp:
        folder = random_hf_models.write_random_folder(args.dummy_weights, Path(tmp) / args.dummy_weights, args.seed)
        log(f"random weights: {args.dummy_weights} (bench/random_hf_models.py, seed {args.seed}) in {folder}")
        return _run(argparse.Namespace(**{**vars(args), "model": str(folder), "dummy_weights": None,
                                          "random_family": args.dummy_weights}), log)


def _run(args: argparse.Namespace, log) -> BenchReport:
    num_requests = args.num_requests or (32 if args.quick else 256)
    output_len = args.output_len or (32 if args.quick else 128)
    hf_sizes = [int(x) for x in (args.hf_batch_sizes or ("1,8,32" if args.quick else "1,8,32,64")).split(",")]
    torch.set_num_threads(args.threads)

    device = resolve_device(args.device)
    config = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "enforce_eager": args.enforce_eager or None}
    if args.kv_cache_gib is not None:
        config["kv_cache_bytes"] = int(args.kv_cache_gib * 2**30)
    t0 = time.time()
    if args.dummy_weights:
        engine = dummy_engine(args.dummy_weights, quantization=args.quantization, device=device, dtype=args.dtype,
                              seed=args.seed, max_position_embeddings=DUMMY_MAX_POSITIONS, tokenizer=args.tokenizer,
                              **config)
    else:
        engine = Engine.from_pretrained(args.model, quantization=args.quantization, device=device, dtype=args.dtype,
                                        **config)
    load_seconds = time.time() - t0
    tokenizer = load_tokenizer(args.tokenizer if args.dummy_weights else args.model)
    prompts = build_workload(tokenizer, num_requests, args.seed)
    lengths = [len(p) for p in prompts]
    log(f"machine: {machine()}")
    log(f"model: {engine.model_name}  quantization={args.quantization}  dtype={engine.runner.dtype}  "
        f"load {load_seconds:.1f} s")
    log(f"compute: {engine.compute}")
    log(f"engine: max_num_seqs={engine.config.max_num_seqs} max_num_batched_tokens="
        f"{engine.config.max_num_batched_tokens} block_size={engine.config.block_size} "
        f"kv_blocks={engine.runner.num_kv_blocks}")
    log(f"workload: {num_requests} requests, prompt tokens min/mean/max {min(lengths)}/"
        f"{sum(lengths) / len(lengths):.0f}/{max(lengths)}, {output_len} output tokens each, EOS ignored")

    # warm-up, not counted: first-call allocations; on CUDA also the Triton compiles, the INT4 kernel
    # choices of every step size the workload makes and the CUDA graphs of its decode batches
    run_engine(engine, prompts if device.startswith("cuda") else prompts[:2], 2)
    engine.reset_prefix_cache()         # every run starts from an empty prefix cache
    clock = KernelClock() if args.breakdown and device == "cpu" else None
    with clock.running() if clock is not None else nullcontext():
        result = run_engine(engine, prompts, output_len)
    report = BenchReport(engine.model_name, engine.runner.num_kv_blocks, lengths, output_len, result)
    total_tps = (result.prompt_tokens + result.output_tokens) / result.seconds
    log("\n== nightshift engine ==")
    log(f"time {result.seconds:.1f} s   steps {result.steps}   preemptions {result.preemptions}")
    log(f"output tok/s {result.output_tps:9.1f}   total tok/s {total_tps:9.1f}")
    log(f"TTFT {percentiles(result.ttft)}")
    log(f"TPOT {percentiles(result.tpot)}")
    log(f"prefix-hit rate {result.cached_tokens / result.prompt_tokens:.1%} "
        f"({result.cached_tokens} of {result.prompt_tokens} prompt tokens)")
    if args.structured:
        report.structured, _ = structured_comparison(engine, prompts, output_len, result, args.repeats, log)
    report.roofline = roofline(engine, args, round(sum(lengths) / len(lengths)), output_len, num_requests)
    if report.roofline is not None:
        r = report.roofline
        log(f"\n== roofline on {r.device} (peak {r.peak.bandwidth / 1e12:.2f} TB/s, "
            f"{r.peak.bf16_flops / 1e12:.0f} TFLOP/s) ==")
        log(r.decode.line("GB/s", "MBU"))
        log(r.prefill.line("GFLOP/s", "MFU"))
    report.floor = floor = matmul_floor(engine, result, num_requests)
    if floor is not None:
        log(f"matmul floor {floor.seconds:.1f} s = {floor.seconds / result.seconds:.0%} of the run: the linear "
            f"layers and LM head alone on its {floor.logits_rows + floor.other_rows} token rows "
            f"({floor.logits_rows} with logits, at {floor.decode_rows}-row steps; the rest at "
            f"{floor.prefill_rows}-row steps without the LM head)")
    if clock is not None:
        report.breakdown = breakdown(engine, clock, result, floor, prompts, output_len, log)
    if args.skip_hf:
        return report
    peers = parse_peers(args.peers or f"hf-{args.hf_dtype}")
    dummy_config = engine.runner.config if args.dummy_weights else None
    del engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    for peer in peers:
        missing = available(peer)
        if missing is not None:
            log(f"\n== {peer}: not run, {missing} ==")
        elif peer.startswith("hf-"):
            report.peers += hf_results(args, peer.removeprefix("hf-"), dummy_config, tokenizer, prompts, output_len,
                                       hf_sizes, device, log)
        elif args.dummy_weights or getattr(args, "random_family", None) or device != "cpu":
            log(f"\n== {peer}: not run (CPU and the real model only) ==")
        elif peer == "ct2":
            log("\n== CTranslate2 generate_batch (greedy, static batches) ==")
            report.peers += ct2_results(args.model, prompts, output_len, hf_sizes, args.threads,
                                        token_text(args.model), log)
        else:
            log("\n== llama.cpp (llama-cpp-python, the model's GGUF file, batched decode) ==")
            report.peers += llamacpp_results(args.model, prompts, output_len, hf_sizes, args.threads, log)
    best = report.best_peer
    if best is None:
        return report
    log("\n== peers, each at its best batch size ==")
    for system in dict.fromkeys(r.system for r in report.peers):
        top = max((r for r in report.peers if r.system == system), key=lambda r: r.output_tps)
        log(f"{system:24s} {top.output_tps:8.1f} output tok/s (batch {top.batch_size}): ours = "
            f"{result.output_tps / top.output_tps:.2f}x")
    log(f"\nratio: engine output tok/s / fastest peer ({best.system}, batch {best.batch_size}) = {report.ratio:.2f}x")
    if floor is not None:
        log(f"5x the fastest peer would be {5 * best.output_tps:.1f} output tok/s: this run in "
            f"{result.output_tokens / (5 * best.output_tps):.1f} s, against a matmul floor of {floor.seconds:.1f} s")
    return report


def hf_results(args, dtype_name: str, dummy_config, tokenizer, prompts, output_len: int, sizes: list[int],
               device: str, log) -> list[PeerResult]:
    """transformers' generate in `dtype_name` at each batch size (left-padded static batches)."""
    dtype = getattr(torch, dtype_name)
    if args.dummy_weights:  # the same random weights (same shape, seed and names) in transformers
        hf = hf_model_from_checkpoint(DummyCheckpoint(dummy_config, seed=args.seed, device=device), dtype, device)
    elif (Path(args.model) / "config.json").exists():   # a Hugging Face folder: transformers' own class of it
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    else:
        hf = hf_model_from_cache(args.model, dtype).to(device)
    pad_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    log(f"\n== HF transformers generate() ({dtype_name}, left-padded static batches, greedy) ==")
    results = []
    for size in sizes:
        count = max(size, args.hf_requests or size)
        seconds, produced, prompt_tokens = run_hf(hf, prompts[:count], output_len, size, pad_id)
        results.append(PeerResult(f"HF {dtype_name}", size, count, seconds, produced, prompt_tokens))
        log(describe_peer(results[-1]))
    return results


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()

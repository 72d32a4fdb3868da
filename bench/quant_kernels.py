"""Time the CPU INT4 kernel against the dense matmul per step size (rows M).

    python -m bench.quant_kernels [--threads 1] [--dtype bfloat16] [--group-size 32]

Shapes are SmolLM2-135M's per-layer projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536). Prints ms per step for: tinygemm int4, dense with the cached dequantized
weight, and dense dequantizing on every call. Used to set DEFAULT_CPU_INT4_MAX_ROWS.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nightshift.engine.quant.cpu_kernels import pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from nightshift.engine.quant.format import quantize_rtn

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30,
                    help="distinct layer sets (30 = the whole model, so weights come from memory, not cache)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES * args.layers:
        w = quantize_rtn(torch.randn(n, k) * 0.02, args.group_size)
        layers.append((w, pack_for_tinygemm(w), tinygemm_scales_and_zeros(w, dtype), w.dequantize(dtype),
                       w.dequantize(torch.float32)))
    print(f"threads={args.threads} dtype={args.dtype} group={args.group_size}; ms per step over "
          f"{args.layers} x (qkv+o+gate_up+down)")
    print(f"{'M':>5} {'int4 tinygemm':>14} {'dense cached':>13} {'dense dequant':>14} {'dense fp32':>11}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=dtype) for _, k in SHAPES}
        xs32 = {k: v.float() for k, v in xs.items()}
        reps = max(2, args.repeats // max(1, m // 16))

        def int4():
            for w, packed, sz, _, _ in layers:
                tinygemm_linear(xs[w.in_features], packed, w.group_size, sz)

        def dense():
            for w, _, _, dense_w, _ in layers:
                F.linear(xs[w.in_features], dense_w)

        def dense32():
            for w, _, _, _, dense_w in layers:
                F.linear(xs32[w.in_features], dense_w)

        def dequant():
            for w, _, _, _, _ in layers:
                F.linear(xs[w.in_features], w.dequantize(dtype))

        print(f"{m:>5} {_time(int4, reps):>14.3f} {_time(dense, reps):>13.3f} {_time(dequant, reps):>14.3f} {_time(dense32, reps):>11.3f}")


if __name__ == "__main__":
    main()

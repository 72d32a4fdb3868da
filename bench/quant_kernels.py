"""Time the INT4 kernels against the dense matmul per step size (rows M).

    python -m bench.quant_kernels [--threads 1] [--dtype bfloat16] [--group-size 32]
    python -m bench.quant_kernels --device cuda [--shapes llama-8b] [--group-size 128]

CPU: shapes are SmolLM2-135M's per-layer projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536). Prints ms per step for: tinygemm int4, dense with the cached dequantized
weight, dense dequantizing on every call, dense float32 (`F.linear`), the float32 CPU math
(the weight packed for oneDNN, engine/layers/cpu_math.py: what a float32 model runs), the bf16
CPU math (bfloat16 weights packed for oneDNN, bfloat16 activations; "-" on CPUs without native
bf16), and our W4A8 kernel (engine/quant/cpu_w4a8.py, bfloat16 in and out as the fused layers
call it; "-" where it does not run), in the form this CPU builds (AVX-512 VNNI where it has it)
and, on such a CPU, its AVX2 form too ("w4a8 avx2"), and our INT4 x bfloat16 kernel of small steps
("w4 bf16", engine/quant/cpu_w4_bf16.py: what an INT4 layer runs instead of tinygemm up to
cpu_int4_max_rows rows where the CPU has AVX-512 BF16; "-" elsewhere). Used to set
DEFAULT_CPU_INT4_MAX_ROWS.

CUDA: one decoder layer's projections (qkv, o, gate_up, down) of the named shape, several
distinct layers so the weights come from memory, not L2, each timed as CUDA-graph replays (no
Python launch overhead, as in the engine's decode steps). Per M: microseconds per layer of
cuBLAS bf16, of our INT4 kernels as the dispatcher chose them (engine/quant/int4_dispatch.py,
which times its candidates on the first call of each shape and M bucket), their GB/s and
TFLOP/s and speed-up over bf16, and torch's CUDA tinygemm (`_weight_int4pack_mm`); then what was
chosen per shape and the runners-up.
"""
from __future__ import annotations

import argparse
import re
import time

import torch
import torch.nn.functional as F

from nightshift.engine.layers import cpu_math
from nightshift.engine.quant import cpu_w4_bf16, cpu_w4a8
from nightshift.engine.quant.cpu_kernels import pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from nightshift.engine.quant.format import quantize_rtn

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


CUDA_SHAPES = {   # one layer's (out_features, in_features): qkv, o, gate_up, down
    "llama-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
    "llama-1b": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)),
    "smollm2-135m": SHAPES,
}


def _graph_time_us(fn, repeats: int) -> float:
    """Median microseconds of a CUDA-graph replay of fn (no Python launch overhead: the engine
    replays its decode steps from graphs too, engine/cuda_graphs.py)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def cuda_main(args) -> None:
    from nightshift.engine.quant.int4_dispatch import KernelWeight, choose, int4_matmul, key_of, timings
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    shapes = CUDA_SHAPES[args.shapes]
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for n, k in shapes:
            int4 = quantize_rtn(torch.randn(n, k, device=device) * 0.02, args.group_size)
            weight = KernelWeight.of(int4)
            layers.append((weight, int4.dequantize(dtype), KernelWeight.of(int4)))
    int4_bytes = sum(w.qweight.nbytes + w.scales.nbytes + w.mins.nbytes for w, _, _ in layers) / args.layers
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    tinygemm_runs = dtype == torch.bfloat16
    print(f"{torch.cuda.get_device_name()}: {args.shapes} layer {[f'{n}x{k}' for n, k in shapes]}, "
          f"group {args.group_size}, {args.dtype}, {args.layers} distinct layers; us per layer (median of "
          f"{args.repeats} CUDA-graph replays)")
    print(f"{'M':>5} {'cuBLAS bf16':>11} {'ours int4':>10} {'GB/s':>7} {'TFLOP/s':>8} {'vs bf16':>8} {'tinygemm':>9}")
    rows = [int(r) for r in args.rows.split(",")]
    keys = {}
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=dtype, device=device) for _, k in shapes}
        for w, _, _ in layers:
            choose(xs[w.in_features], w)       # the dispatcher times its candidates here (first call per key)
            keys[(m, w.out_features, w.in_features)] = key_of(xs[w.in_features], w)

        def dense():
            for w, dense_w, _ in layers:
                F.linear(xs[w.in_features], dense_w)

        def ours():
            for w, _, _ in layers:
                int4_matmul(xs[w.in_features], w)

        def tinygemm():
            for _, _, w in layers:
                packed, sz = w.tinygemm_form()
                torch.ops.aten._weight_int4pack_mm(xs[w.in_features], packed, w.group_size, sz)

        t_dense = _graph_time_us(dense, args.repeats) / args.layers
        t_ours = _graph_time_us(ours, args.repeats) / args.layers
        t_tiny = _graph_time_us(tinygemm, args.repeats) / args.layers if tinygemm_runs else float("nan")
        moved = int4_bytes + 2 * m * sum(n + k for n, k in shapes)
        print(f"{m:>5} {t_dense:>11.1f} {t_ours:>10.1f} {moved / t_ours / 1e3:>7.0f} "
              f"{flops_per_row * m / t_ours / 1e6:>8.1f} {t_dense / t_ours:>7.2f}x {t_tiny:>9.1f}", flush=True)
    print("chosen per shape and M bucket (us of the three fastest candidates, L2 flushed):")
    for m in rows:
        for n, k in shapes:
            timed = timings(keys[(m, n, k)])
            best = ", ".join(f"{c.describe()} {t * 1e3:.1f}" for t, c in timed[:3])
            print(f"  M={m:<5} {n}x{k}: {best}")
            kinds: dict[str, float] = {}
            for t, c in timed:             # fastest first: the first of each kind is its best
                kinds.setdefault(re.split(r" m\d", c.describe())[0], t)
            print("      best of each kind: " + ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in kinds.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--group-size", type=int, default=None, help="default: 32 on CPU, 128 on CUDA")
    ap.add_argument("--rows", default=None, help="default: 1,2,4,8,12,16,32,64,256 (CPU), "
                    "1,2,4,8,16,32,64,128,256,512,2048 (CUDA)")
    ap.add_argument("--repeats", type=int, default=None, help="default: 5 (CPU), 20 (CUDA)")
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct layer sets (default: 30 on CPU = the whole model, 4 on CUDA: more than L2)")
    ap.add_argument("--shapes", default="llama-8b", choices=sorted(CUDA_SHAPES), help="CUDA: the layer shape")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.group_size = args.group_size or (128 if cuda else 32)
    args.rows = args.rows or ("1,2,4,8,16,32,64,128,256,512,2048" if cuda else "1,2,4,8,12,16,32,64,256")
    args.repeats = args.repeats or (20 if cuda else 5)
    args.layers = args.layers or (4 if cuda else 30)
    if cuda:
        cuda_main(args)
        return
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES * args.layers:
        w = quantize_rtn(torch.randn(n, k) * 0.02, args.group_size)
        layers.append((w, pack_for_tinygemm(w), tinygemm_scales_and_zeros(w, dtype), w.dequantize(dtype),
                       w.dequantize(torch.float32)))
    maths = [cpu_math.prepare(dense32, "float32") for _, _, _, _, dense32 in layers]
    bf16_maths = ([cpu_math.prepare(dense32, "bf16") for *_, dense32 in layers]
                  if "bf16" in cpu_math.supported() else None)
    w4a8 = [cpu_w4a8.W4A8Weight(w) for w, *_ in layers] if cpu_w4a8.available() else None
    w4_bf16 = [cpu_w4_bf16.W4Bf16Weight(w) for w, *_ in layers] if cpu_w4_bf16.available() else None
    vnni = cpu_w4a8.uses_vnni()
    print(f"threads={args.threads} dtype={args.dtype} group={args.group_size}; ms per step over "
          f"{args.layers} x (qkv+o+gate_up+down)")
    print(f"{'M':>5} {'int4 tinygemm':>14} {'dense cached':>13} {'dense dequant':>14} {'dense fp32':>11} "
          f"{'fp32 math':>10} {'bf16 math':>10} {'w4a8':>8} {'w4a8 avx2':>10} {'w4 bf16':>8}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=dtype) for _, k in SHAPES}
        xs32 = {k: v.float() for k, v in xs.items()}
        xs16 = {k: v.bfloat16() for k, v in xs.items()}
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

        def math32():
            for (w, *_), held in zip(layers, maths):
                held.linear(xs32[w.in_features])

        def math16():
            for (w, *_), held in zip(layers, bf16_maths):
                held.linear_bf16(xs16[w.in_features])

        def ours(avx2=False):
            for (w, *_), packed in zip(layers, w4a8):
                packed.linear(xs16[w.in_features], avx2=avx2)

        def small_steps():
            for (w, *_), packed in zip(layers, w4_bf16):
                packed.linear(xs16[w.in_features])

        t_16 = f"{_time(math16, reps):>10.3f}" if bf16_maths else f"{'-':>10}"
        t_ours = f"{_time(ours, reps):>8.3f}" if w4a8 else f"{'-':>8}"
        t_avx2 = f"{_time(lambda: ours(avx2=True), reps):>10.3f}" if w4a8 and vnni else f"{'-':>10}"
        t_small = f"{_time(small_steps, reps):>8.3f}" if w4_bf16 else f"{'-':>8}"
        print(f"{m:>5} {_time(int4, reps):>14.3f} {_time(dense, reps):>13.3f} {_time(dequant, reps):>14.3f} "
              f"{_time(dense32, reps):>11.3f} {_time(math32, reps):>10.3f} {t_16} {t_ours} {t_avx2} {t_small}")


if __name__ == "__main__":
    main()

"""What the compiler makes of our INT4 Triton kernels for a Hopper GPU, on a machine without one.

    python -m bench.triton_sass gemv --block-n 16 --block-k 512 --warps 4 --stages 2
    python -m bench.triton_sass swapped --block-m 16 --block-n 64 --block-k 128 --split-k 8 --warps 4 --stages 4
    python -m bench.triton_sass swapped --block-m 64 --block-n 64 --block-k 128 --split-k 4 --stages 3 --dequantized
    python -m bench.triton_sass tiled --block-m 16 --block-n 64 --block-k 128 --split-k 4 --warps 4 --stages 4

Compiles one configuration of engine/quant/triton_int4.py's kernels for sm_90 (Triton's own
compiler and the ptxas and cuobjdump in its wheel; no GPU needed) and prints its registers, stack
(spills), shared memory, the layout conversions left in its Triton GPU IR, and the instruction mix
of its main loop with the weights each thread handles per iteration: where a kernel's instructions
go before a GPU session spends minutes timing it. The JIT specializes pointer and integer
arguments divisible by 16; these compiles mark them so (as on the 8B shapes), M excepted.

These are leads, not timings: the installed Triton may differ from the GPU machine's, and fewer
instructions a weight need not be faster (nightshift/engine/kernels/README.md, GPU session of
2026-11-28: a GEMV with ~3.9 instructions a weight against ~5-8 lost on every shape, its blocks too
few to hide the memory latency). Occupancy follows from the registers: 65,536 a multiprocessor.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

GROUP = 128     # the 8B shapes' quantization group


@dataclass
class SassReport:
    registers: int
    stack_bytes: int                   # spills land here (local memory)
    shared_bytes: int                  # dynamic, as launched
    layout_conversions: int            # ttg.convert_layout ops in the Triton GPU IR
    loop: Counter                      # opcode -> count, in the kernel's longest loop
    instructions: int                  # in the whole kernel

    def lines(self, weights_per_iteration: int) -> list[str]:
        loop_total = sum(self.loop.values())
        mix = ", ".join(f"{op} {n}" for op, n in self.loop.most_common())
        per_weight = f" = {loop_total / weights_per_iteration:.1f} a weight" if weights_per_iteration else ""
        return [f"registers {self.registers}, stack {self.stack_bytes} B, shared {self.shared_bytes} B, "
                f"layout conversions {self.layout_conversions}, {self.instructions} instructions",
                f"main loop: {loop_total} instructions a thread for {weights_per_iteration} weights{per_weight}",
                f"  {mix}"]


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 not_divisible: tuple[str, ...] = ()):
    """The kernel compiled for sm_90 with its pointer and int arguments marked divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(signature)
    divisible = [n for n in names if n not in not_divisible and (signature[n].startswith("*") or signature[n] == "i32")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def loop_mix(sass: str) -> Counter:
    """Opcodes of the longest loop in a cuobjdump SASS listing (the span of its longest backward branch)."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]
    best: list[str] = []
    for address, text in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= address]
            best = max(best, body, key=len)
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)


def report(kernel) -> SassReport:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass, re.M))
    return SassReport(int(fields["REG"]), int(fields["STACK"]) + int(fields.get("LOCAL", 0)), kernel.metadata.shared,
                      kernel.asm["ttgir"].count("ttg.convert_layout"), loop_mix(sass), count)


def int4_kernel(kind: str, block_m: int, block_n: int, block_k: int, split_k: int, warps: int, stages: int,
                dequantized: bool = False):
    """(compiled kernel, weights a thread handles per main-loop iteration) of one INT4 configuration,
    bfloat16 activations, group 128."""
    from nightshift.engine.quant import triton_int4 as t

    common = {"x_ptr": "*bf16", "qw_ptr": "*i32" if kind == "gemv" else "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16"}
    if kind == "gemv":
        signature = {**common, "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_qn": "i32", "stride_sn": "i32",
                     "stride_ys": "i32"}
        kernel = compile_sm90(t._int4_gemv_kernel, signature, {"BLOCK_N": block_n, "GROUP": GROUP,
                              "GROUPS": block_k // GROUP, "SPLIT_K": split_k}, warps, stages)
        return kernel, block_n * block_k // (32 * warps)
    signature = {**common, "y_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                 "stride_qn": "i32", "stride_sn": "i32", "stride_ys": "i32", "stride_ym": "i32"}
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP": GROUP, "SPLIT_K": split_k,
                 "DOT_FLOAT32": False}
    if kind == "swapped":
        fn = t._int4_swapped_kernel
        constants["EXACT"] = not dequantized
    elif kind == "tiled":
        fn = t._int4_tiled_kernel
    else:
        raise ValueError(f"unknown kernel {kind!r}: gemv, tiled or swapped")
    kernel = compile_sm90(fn, signature, constants, warps, stages, not_divisible=("M",))
    return kernel, block_n * block_k // (32 * warps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=["gemv", "tiled", "swapped"])
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=16)
    ap.add_argument("--block-k", type=int, default=512, help="channels a step (the GEMV: whole groups of 128)")
    ap.add_argument("--split-k", type=int, default=1)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dequantized", action="store_true", help="swapped: the weight dequantized in registers")
    args = ap.parse_args(argv)
    kernel, weights = int4_kernel(args.kernel, args.block_m, args.block_n, args.block_k, args.split_k, args.warps,
                                  args.stages, args.dequantized)
    print(f"{args.kernel} m{args.block_m} n{args.block_n} k{args.block_k} split{args.split_k} w{args.warps} "
          f"s{args.stages}{' dequantized' if args.dequantized else ''}, sm_90, bfloat16, group {GROUP}:")
    for line in report(kernel).lines(weights):
        print("  " + line)


if __name__ == "__main__":
    main()

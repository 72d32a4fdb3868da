"""bench.triton_sass: our INT4 kernels compiled for sm_90 without a GPU, read back from their SASS (in a
subprocess: the tests' conftest makes Triton interpret kernels, and an interpreted kernel does not compile)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench import triton_sass

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "bench.triton_sass", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_gemv_and_the_swapped_tile_compile_for_hopper_and_their_loops_are_read():
    gemv = _run("gemv", "--block-n", "16", "--block-k", "512")
    registers = int(re.search(r"registers (\d+), stack 0 B", gemv).group(1))
    assert 0 < registers <= 255
    loop = re.search(r"main loop: (\d+) instructions a thread for 64 weights = ([\d.]+) a weight", gemv)
    assert loop and float(loop.group(2)) == round(int(loop.group(1)) / 64, 1)
    assert int(re.search(r"\bFFMA (\d+)", gemv).group(1)) >= 32     # a multiply-add a weight, but a chain's first
    swapped = _run("swapped", "--block-m", "16", "--block-n", "64", "--block-k", "128", "--split-k", "8", "--stages", "4")
    assert re.search(r"\bHGMMA \d+", swapped)                           # Hopper's warpgroup MMA in the loop
    assert int(re.search(r"shared (\d+) B", swapped).group(1)) > 0      # its operands staged in shared memory


def test_the_longest_backward_branch_bounds_the_loop():
    sass = "\n".join(["        /*0000*/                   MOV R1, c[0x0][0x28] ;",
                      "        /*0010*/                   FFMA R2, R3, R4, R2 ;",
                      "        /*0020*/               @P0 LOP3.LUT R5, R5, 0xf, RZ, 0xc0, !PT ;",
                      "        /*0030*/              @!P0 BRA 0x10 ;",
                      "        /*0040*/                   EXIT ;"])
    assert triton_sass.loop_mix(sass) == Counter({"FFMA": 1, "LOP3": 1, "BRA": 1})

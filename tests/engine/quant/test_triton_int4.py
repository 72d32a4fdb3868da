"""The Triton INT4 kernels (GEMV, tensor-core tiles, dequantization + matmul) and the measured
dispatch between them, against the float64 torch reference: run by Triton's CPU interpreter (a
subprocess, since TRITON_INTERPRET must be set before the kernels are defined) and, when a CUDA
GPU is present, compiled on the GPU with every candidate configuration on real shapes."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

CHECK = r"""
import torch
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.quant.int4_dispatch import (KernelWeight, candidates, choices, int4_matmul, run_config,
                                                   tinygemm_applies, timings)
from nightshift.engine.quant.triton_int4 import KernelConfig, int4_dequantize

device = DEVICE
torch.manual_seed(0)
G, D = KernelConfig("gemv", block_m=1, block_n=16, block_k=32, split_k=3, num_warps=2), KernelConfig("dequant")
tiled = [KernelConfig("tiled", block_m=16, block_n=32, block_k=32, split_k=1),
         KernelConfig("tiled", block_m=16, block_n=32, block_k=32, split_k=4),
         KernelConfig("tiled", block_m=32, block_n=64, block_k=64, split_k=2)]
swapped = [KernelConfig("swapped", block_m=16, block_n=32, block_k=64),                     # the bias trick
           KernelConfig("swapped", block_m=16, block_n=32, block_k=64, split_k=2, exact=False),  # dequantized
           KernelConfig("swapped", block_m=16, block_n=32, block_k=32, split_k=3),
           KernelConfig("swapped", block_m=32, block_n=16, block_k=64, exact=False)]
cases = [  # m, n, k, group, dtype, configs, tolerance (relative to max |ref|)
    (1, 48, 128, 32, torch.float32, [G, tiled[0], D], 1e-5),            # a decode row, split-K 3 over 4 groups
    # 2e-5: the dispatcher may pick a GEMV whose group sums are of 128 + q (1.08e-5 seen on an H200)
    (1, 40, 256, 128, torch.float32, [KernelConfig("gemv", block_m=1, block_n=32, block_k=128)], 2e-5),
    # GEMV steps of several groups: K not a multiple of the step (the last step half empty), split-K
    (1, 40, 384, 64, torch.float32, [KernelConfig("gemv", block_m=1, block_n=16, block_k=256, num_warps=2),
                                     KernelConfig("gemv", block_m=1, block_n=8, block_k=128, split_k=2)], 1e-5),
    (1, 24, 576, 64, torch.bfloat16, [KernelConfig("gemv", block_m=1, block_n=8, block_k=512)], 1e-2),
    (1, 24, 256, 32, torch.float16, [KernelConfig("gemv", block_m=1, block_n=8, block_k=64, split_k=2)], 2e-3),
    (3, 40, 256, 64, torch.float32, tiled + [D], 1e-5),                  # N not a tile multiple, split-K
    (20, 64, 192, 64, torch.float32, tiled + [D], 1e-5),                 # M over one tile
    (5, 32, 128, 32, torch.float16, tiled[:2] + [D], 2e-3),
    (5, 32, 128, 32, torch.bfloat16, tiled[:2] + [D], 1e-2),
    # the swapped tiles: a decode row, M over one tile with N not a tile multiple, 16-bit activations
    (1, 48, 192, 64, torch.float32, swapped, 1e-5),
    (20, 40, 384, 128, torch.float32, swapped, 2e-5),     # three steps of 128 + q sums (the dispatch: tiles)
    (5, 32, 128, 64, torch.bfloat16, swapped, 1e-2),
    (35, 24, 192, 64, torch.float16, swapped, 2e-3),
]
if device == "cuda":  # real shapes, every candidate the dispatcher may pick (tinygemm too), then the dispatcher
    cases += [(m, n, k, 128, torch.bfloat16, candidates(m, 128, tinygemm=True), 2e-2) for m in (1, 2, 16, 64, 300)
              for n, k in ((4096, 4096), (1024, 14336))]
checked = 0
shard, shards = SHARD
for m, n, k, g, dtype, configs, tol in cases[shard::shards]:
    int4 = quantize_rtn(torch.randn(n, k) * 0.05, g).to(device)
    w = KernelWeight.of(int4)
    x = torch.randn(m, k, device=device)
    ref = x.double() @ int4.dequantize(torch.float64).t()
    # bit-equal to Int4Weight.dequantize (the interpreter casts to bfloat16 by truncation: float32 there)
    cast = dtype if device == "cuda" or dtype != torch.bfloat16 else torch.float32
    dense = int4_dequantize(w.qweight, w.scales, w.mins, g, cast)
    assert torch.equal(dense, int4.dequantize(cast)), "dequantize kernel differs from Int4Weight.dequantize"
    runs = [(c.describe(), lambda c=c: run_config(x.to(dtype), w, c)) for c in configs]
    runs.append(("dispatch", lambda: int4_matmul(x.to(dtype), w)))
    for name, run in runs:
        y = run()
        assert y.dtype == dtype and y.shape == (m, n), (name, y.dtype, y.shape)
        assert y.isfinite().all(), (name, m, n, k)
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, (name, m, n, k, g, dtype, err)
        again = run()
        assert torch.equal(y, again), (name, "not deterministic")
        checked += 1
print("checked", checked)
if shard:   # the dispatcher's own checks below run once, in shard 0
    raise SystemExit(0)
# measure(): the correct options timed, fastest first; one computing garbage dropped; none correct: an error
from nightshift.engine.quant import int4_dispatch
w = KernelWeight.of(quantize_rtn(torch.randn(64, 128) * 0.05, 32).to(device))
opts = [tiled[0], D, tiled[1]]
real = int4_dispatch.run_config
int4_dispatch.run_config = lambda x, weight, c: real(x, weight, c) * (3 if c is opts[2] else 1)
costs = iter([3.0, 1.0])
timed = int4_dispatch.measure(w, opts, 4, torch.float32, lambda fn: (fn(), next(costs))[1])
assert [(t, c) for t, c in timed] == [(1.0, D), (3.0, tiled[0])], timed
try:
    int4_dispatch.measure(w, [opts[2]], 4, torch.float32, lambda fn: 1.0)
    raise AssertionError("measure() accepted a kernel that computes garbage")
except RuntimeError as err:
    assert "no INT4 kernel ran correctly" in str(err)
int4_dispatch.run_config = real
print("measure ok")
for key, config in choices().items():
    print("chosen", key, config.describe(), "of", len(timings(key)) or "untimed")
"""


def _run(device: str, interpret: bool, shards: int = 1) -> str:
    """CHECK in `shards` processes at once, each taking every shards-th case (on a GPU the time
    goes to compiling ~100 kernels one after another: a lent machine's cores compile them side by
    side; cold, one process took over 180 s on an H200 host). Their outputs, shard 0's first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(shards)]
    procs = [subprocess.Popen([sys.executable, "-c", CHECK.replace("DEVICE", repr(device)).replace(
        "SHARD", repr((i, shards)))], env=env, cwd=REPO, stdout=out, stderr=err, text=True)
        for i, (out, err) in enumerate(files)]
    outputs = []
    for proc, (out, err) in zip(procs, files):
        proc.wait(timeout=900)
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]
        outputs.append(out.read())
    return "".join(outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiled on the GPU there (the next test); the interpreter "
                    "of Triton 3.6, on the lent GPUs, cannot run a loop that starts at a program id")
def test_triton_int4_kernels_under_interpreter():
    out = _run("cpu", interpret=True)
    assert "checked 51" in out and "measure ok" in out, out


def test_triton_int4_kernels_on_the_gpu_when_present(monkeypatch):
    """On a CUDA machine: every kernel configuration compiled (tinygemm's too), small and real shapes,
    and the dispatcher's timing and checking. Without a
    GPU the kernels can only run under the interpreter (the test above); this then checks that
    Int4Linear on CPU does not route to Triton."""
    if torch.cuda.is_available():
        shards = min(4, os.cpu_count() or 1)
        out = _run("cuda", interpret=False, shards=shards)
        print(out)
        checked = [int(line.split()[1]) for line in out.splitlines() if line.startswith("checked")]
        assert len(checked) == shards and all(checked), out
        assert "measure ok" in out and "chosen" in out and "untimed" not in out
    else:
        from nightshift.engine.quant.format import quantize_rtn
        from nightshift.engine.quant.int4_linear import Int4Linear
        monkeypatch.setitem(sys.modules, "nightshift.engine.quant.triton_int4", None)  # importing it would fail
        layer = Int4Linear(quantize_rtn(torch.randn(32, 64), 32))
        assert layer(torch.randn(2, 64)).shape == (2, 32)
        assert layer(torch.randn(40, 64)).shape == (40, 32)


def test_kernel_configs_and_candidates():
    from nightshift.engine.quant.int4_dispatch import candidates, m_bucket
    from nightshift.engine.quant.triton_int4 import KernelConfig
    with pytest.raises(ValueError, match="at least 32"):
        KernelConfig("tiled", block_k=16)          # computed wrong results on an H200: never a candidate
    with pytest.raises(ValueError, match="unknown INT4 method"):
        KernelConfig("magic")
    assert [m_bucket(m) for m in (1, 2, 3, 16, 17, 5000)] == [1, 2, 4, 16, 32, 4096]
    for m in (1, 2, 16, 64, 512):
        for group in (32, 64, 128):
            found = candidates(m, group, tinygemm=True)
            assert found and all(group % c.block_k == 0 for c in found if c.method in ("tiled", "swapped"))
            assert any(c.method == "swapped" for c in found) == (m > 1)
            assert all(c.block_k % group == 0 for c in found if c.method == "gemv")
            assert any(c.method == "gemv" for c in found) == (m == 1)
            assert any(c.method == "dequant" for c in found) == (m > 1)
            assert any(c.method == "tinygemm" for c in found) == (m <= 64)
    assert not any(c.method == "tinygemm" for c in candidates(1, 128))

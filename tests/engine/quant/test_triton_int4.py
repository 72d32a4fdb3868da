"""The Triton INT4 kernels (GEMV, tensor-core tiles, dequantization + matmul) and the measured
dispatch between them, against the float64 torch reference: run by Triton's CPU interpreter (a
subprocess, since TRITON_INTERPRET must be set before the kernels are defined) and, when a CUDA
GPU is present, compiled on the GPU with every candidate configuration on real shapes."""
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]

CHECK = r"""
import torch
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.quant.int4_dispatch import candidates, choices, int4_matmul
from nightshift.engine.quant.triton_int4 import KernelConfig, int4_dequantize, int4_matmul_with

device = DEVICE
torch.manual_seed(0)
G, T, D = KernelConfig("gemv", block_m=1, block_n=16, block_k=32, split_k=3, num_warps=2), None, KernelConfig("dequant")
tiled = [KernelConfig("tiled", block_m=16, block_n=32, block_k=32, split_k=1),
         KernelConfig("tiled", block_m=16, block_n=32, block_k=16, split_k=4),
         KernelConfig("tiled", block_m=32, block_n=64, block_k=64, split_k=2)]
cases = [  # m, n, k, group, dtype, configs, tolerance (relative to max |ref|)
    (1, 48, 128, 32, torch.float32, [G, tiled[0], D], 1e-5),            # a decode row, split-K 3 over 4 groups
    (1, 40, 256, 128, torch.float32, [KernelConfig("gemv", block_m=1, block_n=32, block_k=128)], 1e-5),
    (3, 40, 256, 64, torch.float32, tiled + [D], 1e-5),                  # N not a tile multiple, split-K
    (20, 64, 192, 64, torch.float32, tiled + [D], 1e-5),                 # M over one tile
    (5, 32, 128, 32, torch.float16, tiled[:2] + [D], 2e-3),
    (5, 32, 128, 32, torch.bfloat16, tiled[:2] + [D], 1e-2),
]
if device == "cuda":  # real shapes, every candidate the dispatcher may pick, then the dispatcher itself
    cases += [(m, n, k, 128, torch.bfloat16, candidates(m, 128), 2e-2) for m in (1, 2, 16, 64, 300)
              for n, k in ((4096, 4096), (1024, 14336))]
checked = 0
for m, n, k, g, dtype, configs, tol in cases:
    w = quantize_rtn(torch.randn(n, k) * 0.05, g).to(device)
    x = torch.randn(m, k, device=device)
    ref = x.double() @ w.dequantize(torch.float64).t()
    # bit-equal to Int4Weight.dequantize (the interpreter casts to bfloat16 by truncation: float32 there)
    cast = dtype if device == "cuda" or dtype != torch.bfloat16 else torch.float32
    dense = int4_dequantize(w.qweight, w.scales, w.mins, g, cast)
    assert torch.equal(dense, w.dequantize(cast)), "dequantize kernel differs from Int4Weight.dequantize"
    runs = [(c.describe(), lambda c=c: int4_matmul_with(x.to(dtype), w.qweight, w.scales, w.mins, g, c))
            for c in configs]
    runs.append(("dispatch", lambda: int4_matmul(x.to(dtype), w.qweight, w.scales, w.mins, g)))
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
for key, config in choices().items():
    print("chosen", key, config.describe())
"""


def _run(device: str, interpret: bool) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK.replace("DEVICE", repr(device))], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_triton_int4_kernels_under_interpreter():
    out = _run("cpu", interpret=True)
    assert "checked 24" in out, out


def test_triton_int4_kernels_on_the_gpu_when_present(monkeypatch):
    """On a CUDA machine: every kernel configuration compiled, small and real shapes. Without a
    GPU the kernels can only run under the interpreter (the test above); this then checks that
    Int4Linear on CPU does not route to Triton."""
    if torch.cuda.is_available():
        out = _run("cuda", interpret=False)
        print(out)
        assert "checked" in out and "chosen" in out
    else:
        from nightshift.engine.quant.format import quantize_rtn
        from nightshift.engine.quant.int4_linear import Int4Linear
        monkeypatch.setitem(sys.modules, "nightshift.engine.quant.triton_int4", None)  # importing it would fail
        layer = Int4Linear(quantize_rtn(torch.randn(32, 64), 32))
        assert layer(torch.randn(2, 64)).shape == (2, 32)
        assert layer(torch.randn(40, 64)).shape == (40, 32)

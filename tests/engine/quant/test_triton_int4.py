"""The Triton INT4 dequant-GEMM against the torch reference, run by Triton's CPU interpreter
(a subprocess, since TRITON_INTERPRET must be set before the kernel is defined) and, when a
CUDA GPU is present, on the GPU."""
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]

CHECK = r"""
import torch
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.quant.triton_int4 import int4_matmul

device = DEVICE
torch.manual_seed(0)
cases = [  # m, n, k, group, dtype, block_n, block_kh, split_k, tolerance (relative to max |ref|)
    (1, 48, 128, 32, torch.float32, 16, 16, None, 1e-5),     # decode row, auto split-K
    (3, 40, 256, 128, torch.float32, 16, 16, 4, 1e-5),       # N not a tile multiple, split-K 4
    (20, 64, 192, 64, torch.float32, 32, 32, 1, 1e-5),       # M over one tile, K tail masked
    (5, 32, 128, 32, torch.float16, 16, 16, 2, 2e-3),
    (5, 32, 128, 32, torch.bfloat16, 16, 16, 1, 1e-2),
]
if device == "cuda":  # real shapes with the default tiles on a GPU
    cases += [(m, 960, 576, 32, dt, 64, 32, None, 2e-2) for m in (1, 7, 64, 300)
              for dt in (torch.float16, torch.bfloat16)]
for m, n, k, g, dtype, bn, bkh, sk, tol in cases:
    w = quantize_rtn(torch.randn(n, k) * 0.05, g).to(device)
    x = torch.randn(m, k, device=device)
    ref = x.double() @ w.dequantize(torch.float64).t()
    y = int4_matmul(x.to(dtype), w.qweight, w.scales, w.mins, g, block_n=bn, block_kh=bkh, split_k=sk)
    assert y.dtype == dtype and y.shape == (m, n)
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, (m, n, k, g, dtype, err)
    print("ok", m, n, k, g, dtype, err)
"""


def _run(device: str, interpret: bool) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK.replace("DEVICE", repr(device))], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_triton_int4_gemm_under_interpreter():
    out = _run("cpu", interpret=True)
    assert out.count("ok") == 5


def test_triton_int4_gemm_on_the_gpu_when_present(monkeypatch):
    """On a CUDA machine: the compiled kernel, small and real shapes. Without a GPU the
    kernel can only run under the interpreter (the test above); this then checks that
    Int4Linear on CPU does not route to Triton."""
    if torch.cuda.is_available():
        assert _run("cuda", interpret=False).count("ok") == 13
    else:
        from nightshift.engine.quant.format import quantize_rtn
        from nightshift.engine.quant.int4_linear import Int4Linear
        monkeypatch.setitem(sys.modules, "nightshift.engine.quant.triton_int4", None)  # importing it would fail
        layer = Int4Linear(quantize_rtn(torch.randn(32, 64), 32))
        assert layer(torch.randn(2, 64)).shape == (2, 32)
        assert layer(torch.randn(40, 64)).shape == (40, 32)

"""How a float32 model's linear layers multiply on the CPU: the one place that chooses the math.

Three paths (``MATHS``), each a way to hold a layer's weight and multiply by it; the rest of the
model (residual stream, norms, RoPE, attention, KV cache, logits) stays float32 whatever is chosen:

* ``float32``: oneDNN with the weight packed once at load (engine/layers/cpu_gemm.py), or MKL's
  ``F.linear`` where oneDNN is off. What the engine always ran, bit for bit.
* ``bf16``: the weight packed in bfloat16 for oneDNN (avx512_bf16 dot products, AMX tiles);
  the activations are cast to bfloat16 on the way in and the result back to float32 (float32
  accumulation inside). Half the weight bytes and twice the FLOP rate of float32 on such CPUs.
* ``int8``: per-output-channel symmetric int8 weights; each call quantizes its activations per
  token (row: the row's absolute maximum maps to 127), multiplies int8 x int8 into int32
  (``torch._int_mm``: oneDNN's VNNI ``vpdpbusd`` / AMX int8 kernels) and rescales to float32.
  Per-row scales keep every row's result independent of the other rows of the step.

A row's result is independent of how many rows a step has (``row_independent``; checked by
tests/engine/test_cpu_math.py), so an answer does not depend on the batch around it, on every
path but one: bf16 on a CPU with AMX tiles. There oneDNN picks its kernel and blocking by the
call's row count (up to 32 rows and beyond run differently), so a row's last bits move with the
batch (measured on a 2-core Xeon, on one thread and on two: most row counts up to 1,024 differ
from a 1,024-row call in some rows; calls of one fixed 64-row size do not, but cost 10-50% more on
the model's shapes). A bfloat16 model's ``F.linear`` there (the engine's default dtype with AMX)
behaves the same way, as HF's bfloat16 does.

``NIGHTSHIFT_CPU_MATH=float32|bf16|int8|auto`` (default auto) forces a path. ``auto`` keeps the
fastest of the paths this CPU runs natively (``supported``) among ``AUTO_MATHS``, timed on the
model's own projection shapes at a small and a large step (``choose``); float32 stays unless
another is at least ``MARGIN`` faster. The timings are kept on disk per CPU, torch version,
threads and shapes (beside the C kernels' cache), so every process of a machine makes the same
choice and measures once. int8 is left out of ``auto``: on the standard prompts it drifts from
float32 more than HF's own bfloat16 does (bench/quality.py --maths reports it), so it runs only
when asked for.

INT4 layers (engine/quant/int4_linear.py) have their own choice (``choose_int4``): ``dense``
(torch's int4 kernel for steps of a few rows, the dequantized weight on the model's math above)
or ``w4a8`` (engine/quant/cpu_w4a8.py: the 4-bit weight against int8 activations per block of
32, as llama.cpp's Q4 x Q8_0; about half the float32 math's matmul time on an AVX2 EPYC).
``w4a8`` runs only when asked for, ``NIGHTSHIFT_CPU_INT4=dense|w4a8|auto`` (auto: dense), for
the same reason as int8: on the quality prompts the default model on it drifts from HF float32 far more than HF's
own bfloat16 does (``bench/quality.py --maths float32 --int4-kernels dense,w4a8``; its error is
the int8 activations', most of it in the q/k/v projection).
The LM head of a full-precision model on the bf16 math has a choice of its own (``choose_head``):
the math's head ("dense") or, where the checkpoint stores it as Q8_0 blocks (a GGUF's), those
blocks against int8 activations ("q8": layers/q8_head.py, quant/cpu_w8a8.py; the GGUF's exact
weights, the activations int8 per block of 32, each row alone), on every call alike.
``NIGHTSHIFT_CPU_HEAD=dense|q8|auto`` (auto: measured on the head's shape at PROBE_ROWS and cached
like ``choose``'s; q8 where at least MARGIN faster). Unlike int8 and w4a8 above, q8 passes the
quality rule on the default model (layers/q8_head.py has the figures): its int8 rounding is
confined to one projection whose weights it keeps exact.
"""
from __future__ import annotations

import fcntl
from abc import ABC, abstractmethod
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from nightshift.engine.cpu_features import cpu_flags, cpu_has_bf16_dot, cpu_has_int8_dot, cpu_has_native_bf16
from nightshift.engine.kernels.c_library import cache_dir
from nightshift.engine.layers import cpu_gemm

MATHS = ("float32", "bf16", "int8")
AUTO_MATHS = ("float32", "bf16")
ENV = "NIGHTSHIFT_CPU_MATH"
INT4_KERNELS = ("dense", "w4a8")
INT4_ENV = "NIGHTSHIFT_CPU_INT4"
HEAD_FORMS = ("dense", "q8")
HEAD_ENV = "NIGHTSHIFT_CPU_HEAD"
MARGIN = 0.05
PROBE_ROWS = (16, 256)        # a small decode step and a full one (the default max_num_seqs)


def row_independent(math: str) -> bool:
    """Whether a row's result on `math` is bit-identical whatever other rows share the call, on
    this CPU (see the module docstring)."""
    return not (math == "bf16" and cpu_has_native_bf16())


def requested() -> str:
    """The path asked for through NIGHTSHIFT_CPU_MATH: one of MATHS, or "auto" (the default)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in (*MATHS, "auto"):
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join((*MATHS, 'auto'))}")
    return value


def supported() -> tuple[str, ...]:
    """The paths this CPU and torch build run natively (float32 always)."""
    maths = ["float32"]
    if cpu_has_bf16_dot() and cpu_gemm.available():
        maths.append("bf16")
    if cpu_has_int8_dot() and _int_mm_works():
        maths.append("int8")
    return tuple(maths)


@functools.cache
def _int_mm_works() -> bool:
    try:
        out = torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (RuntimeError, AttributeError):
        return False
    return bool((out == 8).all())


class MathWeight(ABC):
    """A layer's weight held for one path; ``linear(x, bias)`` is ``x @ W.T (+ bias)`` in float32."""

    math: str

    @abstractmethod
    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``, float32 in and out."""

    @abstractmethod
    def dense(self) -> torch.Tensor:
        """The weight as a float32 tensor (for inspection; the int8 path gives its rounded values)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes a multiplication reads of this weight."""


class Float32Weight(MathWeight):
    math = "float32"

    def __init__(self, weight: torch.Tensor):
        packed = cpu_gemm.pack(weight)
        self.weight = weight if packed is None else packed

    def linear(self, x, bias=None):
        return cpu_gemm.linear(x, self.weight, bias)

    def dense(self):
        return self.weight.to_dense() if self.weight.is_mkldnn else self.weight

    def nbytes(self):
        return self.weight.numel() * 4


class Bf16Weight(MathWeight):
    math = "bf16"

    def __init__(self, weight: torch.Tensor):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous())

    def linear(self, x, bias=None):
        out = self.linear_bf16(x.to(torch.bfloat16)).float()
        return out if bias is None else out.add_(bias)

    def linear_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` bfloat16 in and out, no casts (float32 accumulation inside): the fused
        decoder layer's form (models/fused_cpu_layer.py), which keeps activations bfloat16
        between its kernels."""
        return cpu_gemm.linear(x, self.weight)

    def dense(self):
        return self.weight.to_dense().float()

    def nbytes(self):
        return self.weight.numel() * 2


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D float tensor: (int8 values, float32 scales [rows, 1]),
    with x ~= values * scales (an all-zero row gets scale 1)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scales).clamp_(-127, 127).to(torch.int8), scales


class Int8Weight(MathWeight):
    math = "int8"

    def __init__(self, weight: torch.Tensor):
        values, scales = quantize_rows(weight.detach().float())
        self.values_t = values.t()                     # [in, out] view of the [out, in] rows
        self.scales = scales.reshape(1, -1).contiguous()

    def linear(self, x, bias=None):
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        values, scales = quantize_rows(x2d)
        out = torch._int_mm(values, self.values_t).float().mul_(scales).mul_(self.scales)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*lead, out.shape[-1])

    def dense(self):
        return self.values_t.t().float() * self.scales.reshape(-1, 1)

    def nbytes(self):
        return self.values_t.numel() + self.scales.numel() * 4


def applies(weight: torch.Tensor, math: str) -> bool:
    """Whether a layer holds `weight` for `math`: a 2-D float32 CPU weight (for float32, only
    with oneDNN's packing available; otherwise `F.linear` on the plain weight is that path)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    return math != "float32" or cpu_gemm.available()


_WEIGHTS = {"float32": Float32Weight, "bf16": Bf16Weight, "int8": Int8Weight}


def prepare(weight: torch.Tensor, math: str) -> MathWeight:
    """`weight` `[out, in]` (float32, CPU) held for `math`."""
    if math not in _WEIGHTS:
        raise ValueError(f"unknown CPU math {math!r}; choose one of {', '.join(MATHS)}")
    return _WEIGHTS[math](weight)


@dataclass(frozen=True)
class Choice:
    """The path a model runs and why: ``seconds`` per candidate (None where not measured)."""
    math: str
    reason: str                                    # "forced" | "measured" | "only float32"
    seconds: Optional[dict] = None

    def describe(self) -> str:
        if self.seconds is None:
            return f"{self.math} ({self.reason})"
        timings = ", ".join(f"{name} {secs * 1000:.1f} ms" for name, secs in self.seconds.items())
        return f"{self.math} ({self.reason}: {timings} for the probe steps)"


def choose(shapes: tuple[tuple[int, int], ...], requested_math: Optional[str] = None) -> Choice:
    """The path for a float32 CPU model whose projections have these ``[out, in]`` shapes (the
    LM head included): ``requested_math`` or NIGHTSHIFT_CPU_MATH when not "auto", else measured."""
    math = requested_math or requested()
    if math != "auto":
        if math not in MATHS:
            raise ValueError(f"unknown CPU math {math!r}; choose one of {', '.join((*MATHS, 'auto'))}")
        return Choice(math, "forced")
    candidates = tuple(m for m in AUTO_MATHS if m in supported())
    if candidates == ("float32",):
        return Choice("float32", "only float32")
    shapes = tuple(shapes)
    seconds = _measured("cpu_math", [shapes, PROBE_ROWS], candidates, lambda math: _time_math(shapes, math))
    best = min(candidates, key=seconds.__getitem__)
    if best != "float32" and seconds[best] > seconds["float32"] * (1 - MARGIN):
        best = "float32"
    return Choice(best, "measured", seconds)


def _measured(kind: str, key_parts: list, candidates: tuple[str, ...], time_one) -> dict:  # noqa: ANN001
    """``time_one(candidate)`` seconds of each candidate, from the disk cache when this machine
    (CPU flags, torch version, threads) measured them before for the same `kind` and `key_parts`."""
    key = json.dumps([torch.__version__, sorted(cpu_flags()), torch.get_num_threads(), *key_parts, candidates])
    path = cache_dir() / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # one process measures, the others of the machine wait for its answer: all choose alike
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        seconds = {candidate: time_one(candidate) for candidate in candidates}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(seconds))
        os.replace(tmp, path)
        return seconds


def _time_math(shapes: tuple[tuple[int, int], ...], math: str, repeats: int = 3) -> float:
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for out_features, in_features in dict.fromkeys(shapes):
        weight = prepare(torch.randn(out_features, in_features, generator=generator), math)
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=generator)
            total += cpu_gemm.best_seconds(lambda: weight.linear(x), repeats) * shapes.count(
                (out_features, in_features))
    return total


def choose_int4(requested_kernel: Optional[str] = None) -> Choice:
    """How the INT4 layers of a float32 CPU model multiply (the module docstring):
    ``requested_kernel`` or NIGHTSHIFT_CPU_INT4 when not "auto"; "auto" (the default) is dense."""
    from nightshift.engine.quant import cpu_w4a8     # quant imports this module: import on use

    kernel = (requested_kernel or os.environ.get(INT4_ENV, "auto")).strip().lower() or "auto"
    if kernel not in (*INT4_KERNELS, "auto"):
        raise ValueError(f"{INT4_ENV}={kernel!r}: choose one of {', '.join((*INT4_KERNELS, 'auto'))}")
    if kernel == "w4a8" and not cpu_w4a8.available():
        raise RuntimeError(f"{INT4_ENV}=w4a8: the W4A8 kernel needs an x86 CPU with AVX2 and FMA and a C "
                           "compiler (cc); this machine has not both")
    if kernel == "auto":
        return Choice("dense", "default; w4a8 only when asked for")
    return Choice(kernel, "forced")


def choose_head(math: str, shape: tuple[int, int], has_q8_blocks: bool,
                requested_form: Optional[str] = None) -> Choice:
    """How the LM head (`shape` ``[vocab, hidden]``) of a full-precision float32 CPU model on `math`
    multiplies: "dense" (the math's own head: on bf16, bfloat16 weights and activations) or "q8"
    (layers/q8_head.py: the checkpoint's own Q8_0 blocks of it, the GGUF's exact values, against the
    rows quantized to int8 per block of 32; quant/cpu_w8a8.py), on every call alike, so a row's
    logits never depend on its step. "q8" only on the bf16 math, whose head already rounds (the
    float32 path stays exact), and only where the checkpoint stores the head as Q8_0 and the W8A8
    kernel runs: `requested_form` or NIGHTSHIFT_CPU_HEAD when not "auto"; "auto" (the default)
    times both on the head's shape at PROBE_ROWS (kept on disk like ``choose``'s) and keeps "q8"
    only where it is at least MARGIN faster."""
    from nightshift.engine.quant import cpu_w8a8     # quant imports this module: import on use

    form = (requested_form or os.environ.get(HEAD_ENV, "auto")).strip().lower() or "auto"
    if form not in (*HEAD_FORMS, "auto"):
        raise ValueError(f"{HEAD_ENV}={form!r}: choose one of {', '.join((*HEAD_FORMS, 'auto'))}")
    possible = math == "bf16" and has_q8_blocks and cpu_w8a8.available()
    if form == "q8" and not possible:
        raise RuntimeError(f"{HEAD_ENV}=q8: the Q8_0 head needs the bf16 CPU math (this model's is {math}), "
                           "a checkpoint that stores the LM head as Q8_0 blocks (a GGUF's) and the W8A8 kernel "
                           f"(an x86 CPU with AVX2 and a C compiler): here {has_q8_blocks=}, "
                           f"kernel available={cpu_w8a8.available()}")
    if form != "auto":
        return Choice(form, "forced")
    if not possible:
        return Choice("dense", "no Q8_0 head here")
    seconds = _measured("cpu_head", [list(shape), PROBE_ROWS, math], HEAD_FORMS, lambda f: _time_head(shape, f))
    best = "q8" if seconds["q8"] < seconds["dense"] * (1 - MARGIN) else "dense"
    return Choice(best, "measured", seconds)


def _time_head(shape: tuple[int, int], form: str, repeats: int = 3) -> float:
    """Seconds of the head's calls at PROBE_ROWS in `form`, on random weights of its shape, with the
    engine's allocator settings (a step's float32 logits would otherwise page-fault on every call)."""
    from nightshift.engine.cpu_allocator import keep_large_allocations
    from nightshift.engine.quant import cpu_w8a8

    keep_large_allocations()
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(0)
    if form == "q8":
        values = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        head = cpu_w8a8.W8A8Weight(values, torch.rand(out_features, in_features // 32, generator=generator) / 64)
        call = head.linear
    else:
        call = Bf16Weight(torch.randn(out_features, in_features, generator=generator)).linear_bf16
    total = 0.0
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator)
        x = x if form == "q8" else x.to(torch.bfloat16)
        total += cpu_gemm.best_seconds(lambda: call(x), repeats)
    return total

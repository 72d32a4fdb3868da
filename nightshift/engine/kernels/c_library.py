"""Small C kernels for the CPU, built with the system compiler on first use and called through
ctypes (no torch headers, no ninja): one way to build, cache and load them.

`load_library(name, source, flags)` compiles `source` (`cc <flags> -fPIC -shared -lm`), caches the
shared object on disk under ~/.cache/nightshift/cpu_kernels (or $NIGHTSHIFT_KERNEL_CACHE) keyed by
a hash of the source, the flags, the machine and the CPU's flags, and loads it; where there is no
compiler or the build fails it warns once and returns None, and the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

from nightshift.engine.cpu_features import cpu_flags

OPTIMIZE = ["-O3", "-march=native", "-fopenmp"]

# e^x of 16 floats on AVX-512F (defined only where the build has AVX-512F), for a kernel's source to
# include (the softmax of the attention kernels, SiLU): inline, where glibc's vector expf is a call
# per 16 lanes (~12% of a decode attention call on a Zen 5, ~25% of a SiLU-and-mul call)
EXP16_AVX512 = r"""
#ifdef __AVX512F__
#include <immintrin.h>
/* e^x of 16 floats: x = n ln2 + r (|r| <= ln2 / 2), e^r by its Taylor series to r^7 (relative error
   under 1e-8 before the float32 roundings), scaled by 2^n; 0 below -87.3 (e^-87.3 is under float32's
   smallest normal), so a masked or padding score of -inf gets probability 0 */
static inline __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);     /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 e = _mm512_set1_ps(1.f / 5040.f);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 720.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(live, e, n);
}
#endif
"""

_lock = threading.Lock()
_libraries: dict[str, Optional[ctypes.CDLL]] = {}


def cache_dir() -> Path:
    root = os.environ.get("NIGHTSHIFT_KERNEL_CACHE") or Path.home() / ".cache" / "nightshift" / "cpu_kernels"
    return Path(root)


def _build(target: Path, source: str, flags: list[str]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, "-fPIC", "-shared", str(src), "-o", str(out), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders each write their own temp file


def load_library(name: str, source: str, flags: list[str]) -> Optional[ctypes.CDLL]:
    """The library built from `source` with `flags` (built on first use, cached on disk and in
    this process); None, with one warning, where it cannot be built."""
    key = hashlib.sha256("\0".join([source, *flags, platform.machine(), *sorted(cpu_flags())]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    with _lock:
        if str(target) in _libraries:
            return _libraries[str(target)]
        _libraries[str(target)] = None
        try:
            if not target.exists():
                _build(target, source, flags)
            _libraries[str(target)] = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            warnings.warn(f"CPU kernel {name} unavailable, using the torch path: {err}")
        return _libraries[str(target)]

"""What the CPU can do fast, read once from /proc/cpuinfo (one answer for the whole engine)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True with AMX bf16 tiles (amx_bf16): the only CPU bf16 matmuls measured faster than float32.
    On the AVX2-only dev box a bf16 linear ran 5-10x slower than float32 (oneDNN emulates bf16
    there); on an AVX-512 box with avx512_bf16 but no AMX, the model's linear layers at 256 rows
    ran 1.7x slower in bf16 (3.40 vs 1.99 ms per token, one thread)."""
    return "amx_bf16" in cpu_flags()

"""What the CPU can do fast, read once from /proc/cpuinfo (one answer for the whole engine)."""
from __future__ import annotations

import functools


def _cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str:
    """The first value of `field` in /proc/cpuinfo ("" where the file or the field is not there)."""
    try:
        with open(path) as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor: "GenuineIntel", "AuthenticAMD" ("" where /proc/cpuinfo is not there).
    Only for tuning constants measured on one vendor's cores (the attention kernel's prefetch
    distances); what the CPU can do is `cpu_flags`."""
    return _cpuinfo("vendor_id")


@functools.cache
def cpu_family() -> int:
    """The CPU's family number ("cpu family": 6 for Intel's cores, 25 for AMD Zen 3 and Zen 4, 26
    for Zen 5; 0 where /proc/cpuinfo does not say). Like `cpu_vendor`, only for tuning constants
    measured on one kind of core."""
    value = _cpuinfo("cpu family")
    return int(value) if value.isdigit() else 0


def cpu_has_native_bf16() -> bool:
    """True with AMX bf16 tiles (amx_bf16): the only CPU bf16 matmuls measured faster than float32.
    On the AVX2-only dev box a bf16 linear ran 5-10x slower than float32 (oneDNN emulates bf16
    there); on an AVX-512 box with avx512_bf16 but no AMX, the model's linear layers at 256 rows
    ran 1.7x slower in bf16 (3.40 vs 1.99 ms per token, one thread). That is a bfloat16 *model*
    (every tensor bf16, `F.linear` unpacked); a float32 model's layers on oneDNN's packed bf16
    weights are faster there, which engine/layers/cpu_math.py measures and chooses."""
    return "amx_bf16" in cpu_flags()


def cpu_has_bf16_dot() -> bool:
    """bfloat16 dot products in hardware: avx512_bf16 (vdpbf16ps) or AMX bf16 tiles. Where they
    are, oneDNN's bf16 matmul with packed weights measured ~2x its float32 one (an AVX-512 Zen 4,
    256 rows: 4.2 vs 8.5 ms per layer of the default model); which math runs is measured per
    model at load (engine/layers/cpu_math.py)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_int8_dot() -> bool:
    """int8 dot products in hardware: VNNI (vpdpbusd, AVX-512 or AVX) or AMX int8 tiles."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())

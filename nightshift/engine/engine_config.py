"""EngineConfig: every engine default in one place, and how the KV pool, device and dtype are
chosen when the caller leaves them open.

Callers (the service's workers, the benchmarks) pass only the values they set; whatever is left
out, or passed as None, takes the default defined here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from nightshift.engine.config_options import config_from_options
from nightshift.engine.cpu_features import cpu_has_native_bf16
from nightshift.engine.kv_cache import kv_bytes_per_block
from nightshift.engine.model_config import ModelConfig

# Sequences per step. 256 rather than 128: on the 2-core dev box a float32 decode step costs
# ~6-14% less per token at 256 (bigger matmuls, fewer per-op overheads per token), and the
# standard bench workload (256 requests) then runs in one wave.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_BYTES = 1 << 30          # on CUDA
CPU_KV_CACHE_FRACTION = 0.2               # of available RAM, on CPU ...
CPU_KV_CACHE_MAX_BYTES = 4 << 30          # ... but at most this


@dataclass
class EngineConfig:
    """max_num_seqs, max_num_batched_tokens: the scheduler's per-step budgets (sequences, new tokens).
    block_size: tokens per KV block. enable_prefix_caching: reuse the KV blocks of equal prompt prefixes.
    num_kv_blocks: the KV pool's size; None sizes it by `kv_pool_blocks`.
    kv_cache_bytes: the pool's memory budget when num_kv_blocks is None; None: default_kv_cache_bytes().
    enforce_eager: run every CUDA step eagerly (no CUDA graphs of decode steps, engine/cuda_graphs.py)."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    num_kv_blocks: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    enforce_eager: bool = False

    @classmethod
    def of(cls, **options) -> "EngineConfig":
        """A config from keyword options where None means "the default" (unknown names: TypeError)."""
        return config_from_options(cls, "engine", options)

    def kv_pool_blocks(self, model: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> int:
        """num_kv_blocks if set; else as many blocks as fit in the memory budget, but never more than
        max_num_seqs full-context sequences can use."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_bytes if self.kv_cache_bytes is not None else default_kv_cache_bytes(device)
        per_block = kv_bytes_per_block(model, self.block_size, dtype)
        most_useful = self.max_num_seqs * math.ceil(model.max_position_embeddings / self.block_size)
        return max(1, min(budget // per_block, most_useful))


def default_kv_cache_bytes(device) -> int:
    """KV pool size when none is given. CUDA: DEFAULT_KV_CACHE_BYTES. CPU: CPU_KV_CACHE_FRACTION
    of the available RAM, at most CPU_KV_CACHE_MAX_BYTES (4 GiB of float32 KV is ~5,800 blocks of
    16 tokens for SmolLM2-135M: the standard bench workload, 256 sequences of ~400 tokens sharing a
    200-token prefix, runs without preemption; 1 GiB gave 14 preemptions)."""
    if torch.device(device).type != "cpu":
        return DEFAULT_KV_CACHE_BYTES
    available = _available_ram_bytes()
    if available is None:
        return DEFAULT_KV_CACHE_BYTES
    return max(DEFAULT_KV_CACHE_BYTES // 4, min(CPU_KV_CACHE_MAX_BYTES, int(available * CPU_KV_CACHE_FRACTION)))


def _available_ram_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_device(device: str) -> str:
    """"auto": CUDA when there is one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: str, cpu_default: Optional[torch.dtype] = None) -> torch.dtype:
    """None picks the measured default: bfloat16 on CUDA; on CPU `cpu_default` where given (the
    generation engine's float32: its layers choose their own CPU math, engine/layers/cpu_math.py),
    else bfloat16 with AMX bf16 tiles and float32 on other CPUs, where bf16 linears measured
    1.7-10x slower (engine/cpu_features.py)."""
    if dtype is None:
        if device.startswith("cuda"):
            return torch.bfloat16
        if cpu_default is not None:
            return cpu_default
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]

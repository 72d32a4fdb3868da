"""Attention backends, and the one place that chooses between them (`select_attention_backend`).

* torch_backend.py       TorchAttention: plain torch on any device, K/V gathered from the pool;
                         decode families, cascade shared-prefix attention and causal masks
                         (the attention arithmetic itself: torch_paged.py).
* cpu_kernel_backend.py  CpuKernelAttention: CPU float32; every row (decode rows and prefill
                         chunks, windows and soft-capping included) through the C kernel of
                         engine/kernels/cpu_paged_attention.py.
* triton_backend.py      TritonAttention: the Triton kernels of engine/kernels/ (store_kv, decode,
                         prefill).

Each has its own metadata type built by `build_metadata(items)`, and `store_kv` / `forward`
for the model's attention layers (base.py). The runner selects its backend once, when it is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nightshift.engine.attention.base import AttentionBackend, StepMetadata
from nightshift.engine.attention.cpu_kernel_backend import CpuKernelAttention
from nightshift.engine.attention.torch_backend import TorchAttention
from nightshift.engine.kernels import cpu_paged_attention
from nightshift.engine.model_config import ModelConfig

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionOptions:
    """attention_backend: "triton" (the kernels of engine/kernels/), "torch", or "auto" (triton on
        CUDA, torch elsewhere).
    cpu_kernel: with "torch" on CPU in float32, the step's rows go through the C kernel
        (CpuKernelAttention) when it builds for the model's shape; otherwise, or when
        NIGHTSHIFT_CPU_ATTENTION=0, the torch path alone (decode_bucket and
        shared_prefix_attention only concern that path).
    decode_bucket, shared_prefix_attention: TorchAttention's options (see attention/torch_backend.py)."""
    attention_backend: str = "auto"
    cpu_kernel: bool = True
    decode_bucket: int = 64
    shared_prefix_attention: bool = True

    def __post_init__(self):
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")


def select_attention_backend(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                             options: AttentionOptions = AttentionOptions()) -> AttentionBackend:
    """The backend a runner of this model, pool and device uses for every step."""
    device = torch.device(device)
    backend = options.attention_backend
    if backend == "auto":
        # the Triton kernels have no sliding window or soft-capping: such models take the torch path
        backend = "triton" if device.type == "cuda" and not config.needs_masked_attention else "torch"
    if backend == "triton":
        from nightshift.engine.attention.triton_backend import TritonAttention   # imports triton: only when chosen
        return TritonAttention(config, block_size, dtype, device)
    if options.cpu_kernel and device.type == "cpu" and \
            cpu_paged_attention.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim):
        return CpuKernelAttention(config, block_size, dtype, device)
    return TorchAttention(config, block_size, dtype, device, options.decode_bucket, options.shared_prefix_attention)


__all__ = ["AttentionBackend", "AttentionOptions", "CpuKernelAttention", "StepMetadata", "TorchAttention",
           "select_attention_backend"]

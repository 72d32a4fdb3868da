"""Roofline arithmetic for the benchmarks: decode MBU and prefill MFU.

* Decode is memory-bound: one step reads every weight once plus the K/V of every position each
  sequence attends to. MBU = those bytes / step time / the device's peak memory bandwidth.
* Prefill is compute-bound: model FLOPs = 2 x (matmul weight elements) per new token, plus
  4 x head_dim per (query, visible key) pair per head per layer (QK^T and PV; causal pairs
  only), plus the LM head for the one logits row per sequence. MFU = FLOPs / time / the device's
  dense bf16 tensor-core peak.

Peaks are the vendors' datasheet figures (dense, no sparsity), looked up by the name
torch.cuda.get_device_name() reports; an unknown device needs explicit peaks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from nightshift.engine.layers.cpu_math import MathWeight
from nightshift.engine.model_config import ModelConfig


@dataclass(frozen=True)
class DevicePeak:
    name: str
    bandwidth: float          # bytes / s
    bf16_flops: float         # dense FLOP / s


# most specific first: the first entry whose key occurs in the lower-cased device name wins
DEVICE_PEAKS: list[tuple[str, DevicePeak]] = [
    ("h200 nvl", DevicePeak("H200 NVL", 4.8e12, 835e12)),
    ("h200", DevicePeak("H200 SXM", 4.8e12, 989e12)),
    ("h100 nvl", DevicePeak("H100 NVL", 3.9e12, 835e12)),
    ("h100 pcie", DevicePeak("H100 PCIe", 2.0e12, 756e12)),
    ("h100", DevicePeak("H100 SXM", 3.35e12, 989e12)),          # "NVIDIA H100 80GB HBM3"
    ("a100 80gb pcie", DevicePeak("A100 80GB PCIe", 1.935e12, 312e12)),
    ("a100-sxm4-80gb", DevicePeak("A100 SXM 80GB", 2.039e12, 312e12)),
    ("a100", DevicePeak("A100 40GB", 1.555e12, 312e12)),
    ("l40s", DevicePeak("L40S", 864e9, 362e12)),
    ("l4", DevicePeak("L4", 300e9, 121e12)),
]


def device_peak(device_name: str, bandwidth: Optional[float] = None, bf16_flops: Optional[float] = None) -> DevicePeak:
    """The peaks of `device_name`; explicit `bandwidth` / `bf16_flops` override the table (and are
    required for a device it does not know)."""
    lowered = device_name.lower()
    known = next((peak for key, peak in DEVICE_PEAKS if key in lowered), None)
    if known is None and (bandwidth is None or bf16_flops is None):
        names = ", ".join(peak.name for _, peak in DEVICE_PEAKS)
        raise ValueError(f"no peak figures for device {device_name!r} (known: {names}); "
                         f"give the peak bandwidth and bf16 FLOP/s explicitly")
    return DevicePeak(known.name if known else device_name,
                      bandwidth if bandwidth is not None else known.bandwidth,
                      bf16_flops if bf16_flops is not None else known.bf16_flops)


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one forward step reads: every parameter and buffer of the model except
    the RoPE tables (only a few rows are read) and, when the LM head is a separate matrix, the
    token embedding (only the batch's rows are read). INT4 layers count their packed weight,
    scales and mins."""
    skip_embedding = getattr(model, "lm_head", None) is not None
    total = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary.") or (skip_embedding and name == "embed_tokens"):
            continue
        total += tensor.numel() * tensor.element_size()
    # weights held for the CPU math (engine/layers/cpu_math.py) are outside the state dict
    return total + sum(m.packed.nbytes() for m in model.modules() if isinstance(getattr(m, "packed", None), MathWeight))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one position, all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def decode_step_bytes(weight_bytes: int, kv_token_bytes: int, context_lens: Iterable[int]) -> int:
    """Bytes one decode step reads: the weights once, plus each sequence's K/V over its context
    (context_lens include the new token)."""
    return weight_bytes + kv_token_bytes * sum(context_lens)


def matmul_params_per_token(config: ModelConfig) -> int:
    """Weight elements of the decoder layers' projections (q, k, v, o, gate, up, down)."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (q_size + 2 * kv_size) + q_size * config.hidden_size
    mlp = 3 * config.hidden_size * config.intermediate_size
    return config.num_layers * (attention + mlp)


def attention_flops(config: ModelConfig, chunks: Iterable[tuple[int, int]]) -> float:
    """QK^T and PV FLOPs over the causal (query, visible key) pairs; chunks: (cached, new)."""
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in chunks)
    return float(4 * config.head_dim * config.num_heads * config.num_layers * pairs)


def prefill_flops(config: ModelConfig, chunks: Iterable[tuple[int, int]]) -> float:
    """Model FLOPs of one prefill step; chunks: (cached tokens, new tokens) per sequence, each
    sequence returning logits for its last token."""
    chunks = list(chunks)
    new_tokens = sum(new for _, new in chunks)
    linear = 2 * matmul_params_per_token(config) * new_tokens
    lm_head = 2 * config.vocab_size * config.hidden_size * len(chunks)
    return float(linear + lm_head) + attention_flops(config, chunks)


def utilisation(amount: float, seconds: float, peak_per_second: float) -> float:
    """Fraction of the peak reached: `amount` (bytes or FLOPs) done in `seconds`."""
    if seconds <= 0 or peak_per_second <= 0:
        raise ValueError(f"seconds ({seconds}) and peak ({peak_per_second}) must be positive")
    return amount / seconds / peak_per_second

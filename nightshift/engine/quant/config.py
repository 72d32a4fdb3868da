"""Which layers run INT4 and how they are quantized."""
from __future__ import annotations

from dataclasses import dataclass, field

from nightshift.engine.quant.format import SUPPORTED_GROUP_SIZES

# Measured with `python -m bench.quant_kernels` on the 2-core AVX-512 dev machine
# (see engine/quant/README.md): torch's CPU int4 kernel beats the dense matmul only for
# steps of at most this many rows; above it the dequantized dense weight is used.
DEFAULT_CPU_INT4_MAX_ROWS = 8

METHODS = ("rtn", "awq", "gptq", "awq-gptq")
CALIBRATED_METHODS = ("awq", "gptq", "awq-gptq")
# Part of every quantized-weight cache file's key (QuantConfig.cache_tag): the same config run
# through changed quantizers gives different weights, and a file written before the change must
# not be read as if it held them. Bump it whenever any method's output for the same checkpoint
# can change: its search or rounding, its defaults (clip ratios, GPTQ damping or column order),
# or the calibration data (texts, answer length). Runtime kernel choices do not count.
QUANTIZER_VERSION = 3


@dataclass(frozen=True)
class QuantConfig:
    """``quantization="int4"`` in Engine.from_pretrained means ``QuantConfig()``.

    group_size: group for round-to-nearest quantization of full-precision weights (a layer
        whose row length it does not divide takes the largest supported group that does). GGUF
        Q4_0/Q4_1 weights keep their own group of 32 (imported as they are, never re-quantized).
    full_precision_layers: layer-name components (between dots) that stay dense, in HF and
        GGUF spelling. The embedding and the
        lm_head are kept by default: the embedding is a row lookup (no matmul to speed up),
        and the lm_head's logits drive sampling directly (SmolLM2 also ties it to the embedding).
    cpu_int4_max_rows: on CPU, steps with at most this many rows use a kernel that reads the
        4-bit weight (ours where the CPU has AVX-512 BF16, engine/quant/cpu_w4_bf16.py, else
        torch's int4 kernel), and LM head calls of at most this many rows a GGUF's Q8_0 blocks
        (engine/layers/q8_head.py); larger ones a dense matmul of the dequantized weight.
    method: how full-precision weights are quantized: "rtn" (round-to-nearest, each group's
        scale/min searched, engine/quant/format.py), "awq" (the same after activation-aware
        per-channel scaling, engine/quant/awq.py), "gptq" (Hessian-based error compensation,
        engine/quant/gptq.py) or "awq-gptq" (AWQ's scaling, then GPTQ). All but "rtn" calibrate
        on a few texts (engine/quant/calibration.py) and need the loader.
    import_gguf_blocks: take GGUF Q4_0/Q4_1 tensors as they are (exact, group 32); False
        quantizes their dequantized values with ``method``/``group_size`` instead.
    cache_dense_weight: keep the dequantized weight (in the activation dtype) for those large
        steps instead of dequantizing it on every call (costs memory, see README for figures).
    """

    group_size: int = 128
    full_precision_layers: tuple[str, ...] = ("embed_tokens", "lm_head", "token_embd", "output")
    cpu_int4_max_rows: int = DEFAULT_CPU_INT4_MAX_ROWS
    cache_dense_weight: bool = True
    import_gguf_blocks: bool = True
    method: str = field(default="rtn")

    def __post_init__(self) -> None:
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r} (supported: {METHODS})")
        if self.cpu_int4_max_rows < 0:
            raise ValueError("cpu_int4_max_rows must be >= 0")

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED_METHODS

    def quantizes(self, layer_name: str) -> bool:
        components = set(layer_name.split("."))
        return not components.intersection(self.full_precision_layers)

    def cache_tag(self) -> str:
        """What changes the stored quantized weights (not the runtime kernel choices)."""
        return (f"int4-{self.method}-v{QUANTIZER_VERSION}-g{self.group_size}-gguf{int(self.import_gguf_blocks)}"
                f"-fp[{','.join(self.full_precision_layers)}]")


def resolve_quant_config(quantization) -> QuantConfig | None:
    """Engine-level argument -> config: "none"/None -> None, "int4" -> defaults, or a QuantConfig."""
    if quantization is None or quantization == "none":
        return None
    if isinstance(quantization, QuantConfig):
        return quantization
    if quantization == "int4":
        return QuantConfig()
    raise ValueError(f"quantization must be 'none' or 'int4', got {quantization!r}")

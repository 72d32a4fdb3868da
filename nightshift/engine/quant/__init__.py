"""INT4 weight-only quantization (format and kernels: see README.md in this folder)."""
from nightshift.engine.quant.config import QuantConfig, resolve_quant_config
from nightshift.engine.quant.format import Int4Weight, pack_int4, quantize_rtn, unpack_int4
from nightshift.engine.quant.gguf_import import int4_from_gguf_blocks, int4_from_gguf_tensor
from nightshift.engine.quant.int4_linear import Int4Linear
from nightshift.engine.quant.linear_factory import Int4LinearFactory

__all__ = ["QuantConfig", "resolve_quant_config", "Int4Weight", "pack_int4", "unpack_int4",
           "quantize_rtn", "int4_from_gguf_blocks", "int4_from_gguf_tensor", "Int4Linear",
           "Int4LinearFactory"]

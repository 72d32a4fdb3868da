"""Converting and loading model checkpoints (GGUF file or Hugging Face directory), and building
the model from one: dense, or with the INT4 layers of engine/quant/.

A GGUF file is converted once into a cache entry (float32 safetensors under Hugging Face names,
plus the raw quantized GGUF blocks for the INT4 path, the config and the tokenizer); later loads
memory-map that entry and take seconds. A Hugging Face directory is read in place (safetensors are
already fast to load). Where sources and entries are: engine/model_files.py.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nightshift.engine.gguf_file import GGUFFile
from nightshift.engine.layers import cpu_math
from nightshift.engine.layers.linear import DenseLinearFactory, GGUFBlocks
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.model_files import (CACHE_FORMAT, atomic_write, cache_entry, cache_root, model_name,
                                           resolve_model, source_fingerprint)
from nightshift.engine.models import LlamaForCausalLM, build_model
from nightshift.engine.quant.cache import QuantizedCheckpointCache, cache_file
from nightshift.engine.quant.calibration import calibration_stats
from nightshift.engine.quant.config import QuantConfig
from nightshift.engine.quant.linear_factory import Int4LinearFactory
from nightshift.engine.tokenizer import load_tokenizer, save_gguf_tokenizer

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.safetensors"
_GGUF_SUFFIX = "@gguf"                    # raw GGUF blocks of tensor X are stored as X@gguf


class Checkpoint:
    """Tensors by Hugging Face name from one or more safetensors files (memory-mapped)."""

    def __init__(self, config: ModelConfig, files: list[Path], gguf_types: Optional[dict[str, int]] = None):
        self.config = config
        self.gguf_types = gguf_types or {}
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def names(self) -> list[str]:
        return [n for n in self._where if not n.endswith(_GGUF_SUFFIX)]

    def tensor(self, name: str) -> Optional[torch.Tensor]:
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def gguf(self, name: str) -> Optional[GGUFBlocks]:
        """Raw GGUF blocks of a quantized tensor (rows in HF order), None if stored as floats."""
        if name not in self.gguf_types:
            return None
        raw = self._where[name + _GGUF_SUFFIX].get_tensor(name + _GGUF_SUFFIX).numpy()
        out_features, in_features = self._where[name].get_slice(name).get_shape()
        return GGUFBlocks(raw, self.gguf_types[name], out_features, in_features)


def convert_gguf(path: str, entry: Path) -> None:
    """GGUF -> cache entry: weights.safetensors (float32 + raw blocks), config.json, tokenizer."""
    gguf = GGUFFile(path)
    names = {t for t in gguf.tensor_names()}
    config = ModelConfig.from_gguf_metadata(gguf.metadata, has_output_weight="output.weight" in names,
                                            name=model_name(path), config_tensors=gguf.config_tensors())
    tensors: dict[str, torch.Tensor] = {}
    gguf_types: dict[str, int] = {}
    for t in gguf.tensors():
        tensors[t.name] = torch.from_numpy(t.dequantize())
        if t.is_quantized:
            tensors[t.name + _GGUF_SUFFIX] = torch.from_numpy(np.array(t.raw, dtype=np.uint8))
            gguf_types[t.name] = int(t.qtype)
    entry.mkdir(parents=True, exist_ok=True)
    atomic_write(entry / WEIGHTS_FILE, lambda tmp: save_file(
        tensors, tmp, metadata={"format": CACHE_FORMAT, "gguf_types": json.dumps(gguf_types)}))
    save_gguf_tokenizer(gguf.metadata, entry)
    atomic_write(entry / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config.to_dict(), indent=1)))


def load_checkpoint(model: str = "default", cache_dir: Optional[str] = None) -> Checkpoint:
    """The checkpoint of `model` (see resolve_model), converting a GGUF into the cache on first use."""
    path = resolve_model(model)
    if Path(path).is_dir():
        cfg = json.loads((Path(path) / "config.json").read_text())
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weight files")
        return Checkpoint(ModelConfig.from_hf_config(cfg, name=model_name(path)), files)
    entry = cache_entry(path, cache_dir)
    if not (entry / "config.json").exists():  # written last: its presence means the entry is complete
        convert_gguf(path, entry)
    config = ModelConfig.from_dict(json.loads((entry / "config.json").read_text()))
    with safe_open(str(entry / WEIGHTS_FILE), framework="pt") as handle:
        gguf_types = json.loads(handle.metadata()["gguf_types"])
    return Checkpoint(config, [entry / WEIGHTS_FILE], gguf_types)


def load_model(model: str = "default", dtype: Optional[torch.dtype] = None, device: str = "cpu",
               quant_config: Optional[QuantConfig] = None, cache_dir: Optional[str] = None,
               cpu_math: Optional[str] = None, cpu_int4: Optional[str] = None,
               cpu_head: Optional[str] = None) -> LlamaForCausalLM:
    """Our LlamaForCausalLM for `model` ("default", a GGUF path or a HF dir); float32 unless `dtype`.

    A float32 model on CPU multiplies through the CPU math of engine/layers/cpu_math.py:
    `cpu_math` (float32, bf16, int8, auto) or, when None, NIGHTSHIFT_CPU_MATH (default auto:
    measured on this model's shapes). The choice is logged and kept as `model.cpu_math` (None
    for other models); its INT4 layers' CPU kernel as `model.cpu_int4`: `cpu_int4` (dense, w4a8,
    auto) or, when None, NIGHTSHIFT_CPU_INT4 (default auto: dense; ``cpu_math.choose_int4``); a
    full-precision model's LM head on the bf16 math as `model.cpu_head`: `cpu_head` (dense, q8, auto)
    or, when None, NIGHTSHIFT_CPU_HEAD (``cpu_math.choose_head``).

    With a quant_config the projections it quantizes are INT4, built by an Int4LinearFactory over
    the quantized-weight cache of this source and config (engine/quant/cache.py): layers found
    there load as stored, the others are quantized and added to the file. The calibrated methods
    measure the float32 model on the calibration texts first, only if some layer is not cached.
    """
    checkpoint = load_checkpoint(model, cache_dir)
    dtype = dtype or torch.float32
    choice = choose_cpu_math(checkpoint.config, dtype, device, cpu_math)
    math = choice.math if choice else "float32"      # the math of float32 CPU layers, if any
    if quant_config is None:
        net = build_model(checkpoint, dtype=dtype, device=device, linear=DenseLinearFactory(math, cpu_head))
        net.cpu_math = choice
        if getattr(net, "cpu_head", None) is not None:
            log.info("CPU LM head: %s", net.cpu_head.describe())
        return net

    def calibrate():
        fp_model = build_model(checkpoint, dtype=torch.float32, device="cpu")
        return calibration_stats(fp_model, load_tokenizer(model, cache_dir=cache_dir))

    cache = QuantizedCheckpointCache(cache_file(cache_root(cache_dir), source_fingerprint(resolve_model(model)),
                                                quant_config))
    int4_choice = choose_cpu_int4_kernel(cpu_int4) if choice else None
    net = build_model(checkpoint, dtype=dtype, device=device,
                      linear=Int4LinearFactory(quant_config, cache, calibrate, math=math,
                                               cpu_kernel=int4_choice.math if int4_choice else "dense"))
    cache.save_if_changed()
    net.cpu_math = choice
    net.cpu_int4 = int4_choice
    return net


def choose_cpu_math(config: ModelConfig, dtype: torch.dtype, device: str,
                    requested: Optional[str] = None) -> Optional[cpu_math.Choice]:
    """The CPU math of a float32 CPU model (engine/layers/cpu_math.py), None for other models
    (their layers run in the model's dtype)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    start = time.perf_counter()
    choice = cpu_math.choose(config.projection_shapes, requested)
    log.info("CPU math: %s, chosen in %.2f s", choice.describe(), time.perf_counter() - start)
    return choice


def choose_cpu_int4_kernel(requested: Optional[str] = None) -> cpu_math.Choice:
    """The CPU kernel of a float32 CPU model's INT4 layers (``cpu_math.choose_int4``), logged."""
    choice = cpu_math.choose_int4(requested)
    log.info("CPU INT4 kernel: %s", choice.describe())
    return choice

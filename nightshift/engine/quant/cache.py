"""On-disk cache of a model's quantized layers, so the next load skips quantization.

One safetensors file per (model source fingerprint, QuantConfig.cache_tag()), under
``<model cache root>/int4/``. For each INT4 layer it holds ``<layer>.qweight``, ``.scales``,
``.mins`` (our format, engine/quant/format.py), ``.input_scale`` for AWQ layers, and the group
size in the metadata.

The loader opens it and hands it to the model's Int4LinearFactory (engine/quant/linear_factory.py)::

    cache = QuantizedCheckpointCache(cache_file(root, fingerprint, quant_config))
    model = build_model(..., linear=Int4LinearFactory(quant_config, cache, calibrate))
    cache.save_if_changed()

The factory takes cached layers from it and puts the layers it had to quantize into it; the
file is then rewritten (atomically) if any were added.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nightshift.engine.quant.config import QuantConfig
from nightshift.engine.quant.format import Int4Weight

FORMAT = "nightshift-int4-v1"
_PARTS = ("qweight", "scales", "mins")


class QuantizedCheckpointCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._weights: dict[str, Int4Weight] = {}
        self._input_scales: dict[str, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0
        if path.exists():
            self._read()

    def _read(self) -> None:
        with safe_open(str(self.path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT:
                return  # an older layout: ignore it, it will be rewritten
            group_sizes = json.loads(meta["group_sizes"])
            for layer, group in group_sizes.items():
                parts = [handle.get_tensor(f"{layer}.{p}") for p in _PARTS]
                self._weights[layer] = Int4Weight(*parts, group_size=int(group))
            for name in handle.keys():
                if name.endswith(".input_scale"):
                    self._input_scales[name[: -len(".input_scale")]] = handle.get_tensor(name)

    def get(self, layer: str) -> Optional[tuple[Int4Weight, Optional[torch.Tensor]]]:
        """(weight, AWQ input scale or None), or None when the layer is not cached."""
        weight = self._weights.get(layer)
        if weight is None:
            return None
        self.hits += 1
        return weight, self._input_scales.get(layer)

    def put(self, layer: str, weight: Int4Weight, input_scale: Optional[torch.Tensor] = None) -> None:
        self.misses += 1
        self._weights[layer] = Int4Weight(*(t.detach().cpu().contiguous() for t in
                                            (weight.qweight, weight.scales, weight.mins)),
                                          group_size=weight.group_size)
        if input_scale is not None:
            self._input_scales[layer] = input_scale.detach().cpu().contiguous()

    def save_if_changed(self) -> None:
        """Rewrite the file when layers were added since it was read."""
        if self.misses:
            self.save()

    def save(self) -> None:
        tensors = {f"{layer}.{p}": getattr(w, p) for layer, w in self._weights.items() for p in _PARTS}
        tensors.update({f"{layer}.input_scale": s for layer, s in self._input_scales.items()})
        meta = {"format": FORMAT,
                "group_sizes": json.dumps({layer: w.group_size for layer, w in self._weights.items()})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def cache_file(root: Path, source_fingerprint: str, config: QuantConfig) -> Path:
    tag = hashlib.sha256(config.cache_tag().encode()).hexdigest()[:16]
    return Path(root) / "int4" / f"{source_fingerprint[:20]}-{tag}.safetensors"

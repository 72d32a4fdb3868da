"""Engine configs built from keyword options, as the worker settings pass them."""
from __future__ import annotations

from dataclasses import fields
from typing import TypeVar

C = TypeVar("C")


def config_from_options(cls: type[C], what: str, options: dict) -> C:
    """``cls`` (a dataclass) from keyword options where None means "the default"; unknown
    names raise TypeError naming ``what`` ("engine", "embedding engine")."""
    unknown = set(options) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"unknown {what} option(s): {', '.join(sorted(unknown))}")
    return cls(**{name: value for name, value in options.items() if value is not None})

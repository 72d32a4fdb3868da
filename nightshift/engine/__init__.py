"""Nightshift's own LLM engine (see DESIGN.md §3). Usable on its own: `from engine import Engine`."""
from nightshift.engine.engine import Engine
from nightshift.engine.loader import load_model, resolve_model
from nightshift.engine.model_runner import ModelRunner, StepItem
from nightshift.engine.tokenizer import Tokenizer, load_tokenizer
from nightshift.engine.types import (EngineStats, GenerationOutput, GenerationRequest, InvalidRequestError, RequestError,
                          SamplingParams)

__all__ = [
    "Engine", "EngineStats", "GenerationOutput", "GenerationRequest", "InvalidRequestError", "ModelRunner", "RequestError",
    "SamplingParams", "StepItem", "Tokenizer", "load_model", "load_tokenizer", "resolve_model",
]

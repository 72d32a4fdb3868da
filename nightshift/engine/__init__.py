"""Nightshift's own LLM engine. Usable on its own: `from nightshift.engine import Engine`.

Layout (nano-vllm's): engine.py (the step loop) with engine_config.py (every default),
scheduler.py, block_manager.py, sequence.py, model_runner.py (one model step) with step.py and
kv_cache.py, attention/ (the backends, chosen once per runner), kernels/ (Triton and C
kernels), models/ and layers/ (the network), sampler.py with logits_processors.py and grammar.py
(structured output), stop_checker.py, loader.py with model_files.py and tokenizer.py, quant/ (INT4).
"""
from nightshift.engine.engine import Engine
from nightshift.engine.engine_config import EngineConfig
from nightshift.engine.loader import load_model
from nightshift.engine.model_files import resolve_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.step import StepItem
from nightshift.engine.tokenizer import Tokenizer, load_tokenizer
from nightshift.engine.types import (Choice, EngineStats, GenerationOutput, GenerationRequest, InvalidRequestError,
                                     RequestError, RequestFeed, SamplingParams, StructuredOutput)

__all__ = [
    "Choice", "Engine", "EngineConfig", "EngineStats", "GenerationOutput", "GenerationRequest", "InvalidRequestError",
    "ModelRunner", "RequestError", "RequestFeed", "SamplingParams", "StepItem", "StructuredOutput", "Tokenizer", "load_model", "load_tokenizer",
    "resolve_model",
]

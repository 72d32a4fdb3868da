"""Engine: the public entry point. Validates requests, runs the step loop, yields outputs.

One step = schedule (Scheduler) -> run the model on every scheduled sequence's new
tokens (ModelRunner) -> sample the sequences that reached their last token (sampler)
-> append, check stops, release finished sequences. Each step's wall time is shared
among the requests in it in proportion to the tokens each processed, which gives every
request its `engine_seconds`.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from nightshift.engine.block_manager import BlockManager
from nightshift.engine.cpu_features import cpu_has_native_bf16
from nightshift.engine.model_runner import ModelRunner, StepItem, kv_bytes_per_block
from nightshift.engine.sampler import sample
from nightshift.engine.scheduler import ScheduledSeq, Scheduler
from nightshift.engine.sequence import Sequence
from nightshift.engine.stop_checker import StopChecker
from nightshift.engine.types import (EngineStats, GenerationOutput, GenerationRequest, InvalidRequestError,
                          RequestError, SamplingParams)

DEFAULT_KV_CACHE_BYTES = 1 << 30          # on CUDA
CPU_KV_CACHE_FRACTION = 0.2               # of available RAM, on CPU ...
CPU_KV_CACHE_MAX_BYTES = 4 << 30          # ... but at most this
# Sequences per step. 256 rather than 128: on the 2-core dev box a float32 decode step costs
# ~6-14% less per token at 256 (bigger matmuls, fewer per-op overheads per token), and the
# standard bench workload (256 requests) then runs in one wave.
DEFAULT_MAX_NUM_SEQS = 256


@dataclass
class EngineConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    enable_prefix_caching: bool = True


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, model_name: str, config: EngineConfig,
                 eos_token_ids: Optional[list[int]] = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.config = config
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.config.vocab_size
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        eos = eos_token_ids if eos_token_ids is not None else list(tokenizer.eos_token_ids)
        self.stop_checker = StopChecker(tokenizer, eos, self.max_model_len)
        self._stats = EngineStats(kv_blocks_total=runner.num_kv_blocks)
        self._active: dict[str, Sequence] = {}
        self._abort_requested: set[str] = set()
        self._lock = threading.Lock()
        self._generating = False

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "default", quantization: str = "int4", device: str = "auto",
                        dtype=None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens: int = 1024,
                        block_size: int = 16, num_kv_blocks: Optional[int] = None,
                        enable_prefix_caching: bool = True, cache_dir: Optional[str] = None,
                        kv_cache_bytes: Optional[int] = None) -> "Engine":
        """Load `model` ("default", a GGUF file or a HF directory) and size the KV pool.

        num_kv_blocks: pool size; by default as many blocks as fit in kv_cache_bytes (default:
        default_kv_cache_bytes()), but never more than max_num_seqs full-context sequences need.
        """
        from nightshift.engine.loader import load_model, model_name, resolve_model
        from nightshift.engine.tokenizer import load_tokenizer

        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        quant_config = resolve_quantization(quantization)
        net = load_model(model, dtype=torch_dtype, device=device, quant_config=quant_config, cache_dir=cache_dir)
        tokenizer = load_tokenizer(model, cache_dir=cache_dir)
        return cls.from_model(net, tokenizer, model_name(resolve_model(model)), max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                              num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_bytes=kv_cache_bytes)

    @classmethod
    def from_model(cls, model, tokenizer, model_name: str, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                   max_num_batched_tokens: int = 1024, block_size: int = 16, num_kv_blocks: Optional[int] = None,
                   enable_prefix_caching: bool = True, kv_cache_bytes: Optional[int] = None) -> "Engine":
        """An engine with its own KV pool around an already loaded model (several may share one)."""
        if num_kv_blocks is None:
            if kv_cache_bytes is None:
                kv_cache_bytes = default_kv_cache_bytes(model.embed_tokens.device)
            per_block = kv_bytes_per_block(model.config, block_size, model.dtype)
            most_useful = max_num_seqs * math.ceil(model.config.max_position_embeddings / block_size)
            num_kv_blocks = max(1, min(kv_cache_bytes // per_block, most_useful))
        runner = ModelRunner(model, num_kv_blocks=num_kv_blocks, block_size=block_size)
        config = EngineConfig(max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching)
        return cls(runner, tokenizer, model_name, config)

    # ---- validation -----------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError (naming the request) if the engine cannot run it."""
        rid = getattr(request, "request_id", None)
        if not isinstance(request, GenerationRequest):
            raise InvalidRequestError(str(rid), "invalid_request",
                                      f"expected a GenerationRequest, got {type(request).__name__}")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(str(rid), "invalid_request", "request_id must be a non-empty string",
                                      "request_id")

        def bad(message: str, param: str, code: str = "invalid_request"):
            raise InvalidRequestError(rid, code, message, param)

        prompt = request.prompt_token_ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            bad("prompt is empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt):
            bad(f"prompt_token_ids must be integers in [0, {self.vocab_size})", "prompt")
        params = request.sampling
        if not isinstance(params, SamplingParams):
            bad(f"sampling must be SamplingParams, got {type(params).__name__}", "sampling")
        _validate_sampling(params, self.vocab_size, bad)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            bad(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens exceeds the "
                f"model's context length of {self.max_model_len}", "max_tokens", "context_length_exceeded")
        blocks = self.block_manager.blocks_for_tokens(total)
        if blocks > self.block_manager.num_blocks:
            bad(f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the engine's KV cache has only "
                f"{self.block_manager.num_blocks}", "max_tokens", "context_length_exceeded")
        if rid in self._active:
            bad("request_id is already running in this engine", "request_id")

    # ---- generation ---------------------------------------------------------------------
    def generate(self, requests: Iterable[GenerationRequest], offline: bool = True) -> Iterator[GenerationOutput]:
        """Run `requests`; yield each one's GenerationOutput as soon as it finishes.

        Invalid requests are yielded first, as finish_reason="error" outputs. offline=True
        reorders admission so requests sharing a prompt prefix run together; False keeps
        arrival order. Closing the iterator early aborts whatever has not finished.
        """
        with self._lock:
            if self._generating:
                raise RuntimeError("Engine.generate() is already running; one call at a time")
            self._generating = True
        try:
            seqs: list[Sequence] = []
            for request in requests:
                try:
                    self.validate(request)
                except InvalidRequestError as err:
                    yield self._error_output(request, err)
                    continue
                seq = Sequence(request, self.block_manager.block_size)
                with self._lock:
                    self._active[seq.request_id] = seq
                self._stats.prompt_tokens += seq.num_prompt_tokens
                seqs.append(seq)
            self.scheduler.add(seqs, offline=offline)
            while self.scheduler.has_unfinished():
                yield from self._take_aborts()
                if not self.scheduler.has_unfinished():
                    break
                for seq in self._step():
                    yield self._finish(seq)
        finally:
            for seq in list(self._active.values()):  # iterator closed early, or an error
                self.scheduler.finish(seq)
                self._active.pop(seq.request_id, None)
            self._abort_requested.clear()
            self._generating = False

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request; generate() yields it with finish_reason="abort".

        Safe to call from another thread. Returns False if no such request is active.
        """
        with self._lock:
            if request_id not in self._active:
                return False
            self._abort_requested.add(request_id)
            return True

    def stats(self) -> EngineStats:
        stats = EngineStats(**vars(self._stats))
        stats.kv_blocks_used = self.block_manager.num_used_blocks
        stats.num_preemptions = self.scheduler.num_preemptions
        return stats

    # ---- internals --------------------------------------------------------------------
    def _take_aborts(self) -> Iterator[GenerationOutput]:
        with self._lock:
            ids, self._abort_requested = self._abort_requested, set()
        for rid in ids:
            seq = self._active.get(rid)
            if seq is None:
                continue
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            seq.text = self.stop_checker.final_text(seq, drop_last=False)
            yield self._finish(seq)

    def _step(self) -> list[Sequence]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise RuntimeError("scheduler made no progress with requests pending (engine bug)")
        items = [StepItem(item.seq.token_ids[item.start_pos:item.start_pos + item.num_new_tokens],
                          item.start_pos, item.seq.block_table, item.need_logits) for item in scheduled]
        logits = self.runner.execute(items)
        sampled = [item.seq for item in scheduled if item.need_logits]
        result = sample(logits, [s.sampling for s in sampled], [s.generator for s in sampled]) if sampled else None
        self.scheduler.complete_step(scheduled)

        now = time.time()
        finished: list[Sequence] = []
        for index, seq in enumerate(sampled):
            seq.append_token(result.token_ids[index], result.logprobs[index])
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.stop_checker.check(seq)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                finished.append(seq)
        self._stats.output_tokens += len(sampled)
        self._account(scheduled, time.perf_counter() - start)
        return finished

    def _account(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Share the step's wall time by tokens processed; split it into prefill and decode."""
        total = sum(item.num_new_tokens for item in scheduled)
        decode_tokens = sum(item.num_new_tokens for item in scheduled if item.is_decode)
        for item in scheduled:
            item.seq.engine_seconds += seconds * item.num_new_tokens / total
        self._stats.num_steps += 1
        self._stats.decode_seconds += seconds * decode_tokens / total
        self._stats.prefill_seconds += seconds * (total - decode_tokens) / total

    def _finish(self, seq: Sequence) -> GenerationOutput:
        self._active.pop(seq.request_id, None)
        cached = seq.cached_prompt_tokens or 0
        self._stats.cached_prompt_tokens += cached
        self._stats.requests_finished += 1
        return GenerationOutput(
            request_id=seq.request_id,
            token_ids=seq.output_token_ids,
            text=seq.text,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=cached,
            completion_tokens=seq.num_output_tokens,
            first_token_time=seq.first_token_time,
            finish_time=time.time(),
            engine_seconds=seq.engine_seconds,
            logprobs=list(seq.output_logprobs) if seq.sampling.logprobs else None,
        )

    def _error_output(self, request, err: InvalidRequestError) -> GenerationOutput:
        prompt = getattr(request, "prompt_token_ids", None)
        return GenerationOutput(
            request_id=err.request_id, token_ids=[], text="", finish_reason="error",
            prompt_tokens=len(prompt) if isinstance(prompt, (list, tuple)) else 0,
            cached_prompt_tokens=0, completion_tokens=0, first_token_time=None, finish_time=time.time(),
            error=RequestError(err.code, err.message, err.param))


def _validate_sampling(params: SamplingParams, vocab_size: int, bad) -> None:
    def number(name: str) -> float:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            bad(f"{name} must be a number, got {value!r}", name)
        return value

    def integer(name: str, allow_none: bool = False) -> Optional[int]:
        value = getattr(params, name)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"{name} must be an integer, got {value!r}", name)
        return value

    if integer("max_tokens") < 1:
        bad(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
    temperature = number("temperature")
    if not 0 <= temperature <= 100 or math.isinf(temperature):
        bad(f"temperature must be between 0 and 100, got {temperature}", "temperature")
    top_p = number("top_p")
    if not 0 < top_p <= 1:
        bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if integer("top_k") < -1:
        bad(f"top_k must be -1, 0 (off) or a positive integer, got {params.top_k}", "top_k")
    integer("seed", allow_none=True)
    for name in ("ignore_eos", "logprobs"):
        if not isinstance(getattr(params, name), bool):
            bad(f"{name} must be true or false, got {getattr(params, name)!r}", name)
    if not isinstance(params.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in params.stop):
        bad(f"stop must be a list of non-empty strings, got {params.stop!r}", "stop")
    if not isinstance(params.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in params.stop_token_ids):
        bad(f"stop_token_ids must be integers in [0, {vocab_size}), got {params.stop_token_ids!r}", "stop_token_ids")


def default_kv_cache_bytes(device) -> int:
    """KV pool size when none is given. CUDA: DEFAULT_KV_CACHE_BYTES. CPU: CPU_KV_CACHE_FRACTION
    of the available RAM, at most CPU_KV_CACHE_MAX_BYTES (4 GiB of float32 KV is ~5,800 blocks of
    16 tokens for SmolLM2-135M: the standard bench workload, 256 sequences of ~400 tokens sharing a
    200-token prefix, runs without preemption; 1 GiB gave 14 preemptions)."""
    if torch.device(device).type != "cpu":
        return DEFAULT_KV_CACHE_BYTES
    available = _available_ram_bytes()
    if available is None:
        return DEFAULT_KV_CACHE_BYTES
    return max(DEFAULT_KV_CACHE_BYTES // 4, min(CPU_KV_CACHE_MAX_BYTES, int(available * CPU_KV_CACHE_FRACTION)))


def _available_ram_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: str) -> torch.dtype:
    """None picks the measured default: bfloat16 on CUDA and on CPUs with AMX bf16 tiles, float32
    on other CPUs, where bf16 linears measured 1.7-10x slower (engine/cpu_features.py)."""
    if dtype is None:
        if device.startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_quantization(quantization: str):
    if quantization in (None, "none"):
        return None
    if quantization != "int4":
        raise ValueError(f"quantization must be 'none' or 'int4', got {quantization!r}")
    try:
        from nightshift.engine.quant.config import QuantConfig
    except ImportError as err:
        raise ValueError(f"quantization='int4' is not available in this build: {err}") from err
    return QuantConfig()

"""Engine: the public entry point. Validates requests, runs the step loop, yields outputs.

One step = schedule (Scheduler) -> run the model on every scheduled sequence's new
tokens (ModelRunner) -> sample the sequences that reached their last token (sampler)
-> append, check stops, release finished sequences. Each step's wall time is shared
among the requests in it in proportion to the tokens each processed, which gives every
request its `engine_seconds`. Defaults of every option: engine_config.py.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator, Optional

from nightshift.engine.block_manager import BlockManager
from nightshift.engine.engine_config import EngineConfig, resolve_device, resolve_dtype
from nightshift.engine.loader import load_model
from nightshift.engine.model_files import model_name, resolve_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.request_validation import check_request
from nightshift.engine.sampler import sample
from nightshift.engine.scheduler import ScheduledSeq, Scheduler
from nightshift.engine.sequence import Sequence
from nightshift.engine.step import StepItem
from nightshift.engine.stop_checker import StopChecker
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import (EngineStats, GenerationOutput, GenerationRequest, InvalidRequestError, RequestError,
                                     RequestFeed, StepReport)


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
        # Called after every step with a StepReport (e.g. a worker's metrics); keep them cheap.
        self.step_listeners: list[Callable[[StepReport], None]] = []

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "default", quantization="int4", device: str = "auto", dtype=None,
                        max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                        block_size: Optional[int] = None, num_kv_blocks: Optional[int] = None,
                        enable_prefix_caching: Optional[bool] = None, cache_dir: Optional[str] = None,
                        kv_cache_bytes: Optional[int] = None) -> "Engine":
        """Load `model` ("default", a GGUF file or a HF directory) and size the KV pool.

        quantization: "int4" (engine/quant/), "none", or a QuantConfig. dtype: None picks by device
        (resolve_dtype). The other options are EngineConfig's; None (or leaving one out) takes its
        default from there.
        """
        config = EngineConfig.of(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 block_size=block_size, num_kv_blocks=num_kv_blocks,
                                 enable_prefix_caching=enable_prefix_caching, kv_cache_bytes=kv_cache_bytes)
        device = resolve_device(device)
        net = load_model(model, dtype=resolve_dtype(dtype, device), device=device,
                         quant_config=resolve_quant_config(quantization), cache_dir=cache_dir)
        tokenizer = load_tokenizer(model, cache_dir=cache_dir)
        return cls.from_model(net, tokenizer, model_name(resolve_model(model)), config=config)

    @classmethod
    def from_model(cls, model, tokenizer, model_name: str, max_num_seqs: Optional[int] = None,
                   max_num_batched_tokens: Optional[int] = None, block_size: Optional[int] = None,
                   num_kv_blocks: Optional[int] = None, enable_prefix_caching: Optional[bool] = None,
                   kv_cache_bytes: Optional[int] = None, config: Optional[EngineConfig] = None) -> "Engine":
        """An engine with its own KV pool around an already loaded model (several may share one).
        Options as for from_pretrained, or a whole `config`."""
        options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, num_kv_blocks=num_kv_blocks,
                       enable_prefix_caching=enable_prefix_caching, kv_cache_bytes=kv_cache_bytes)
        if config is None:
            config = EngineConfig.of(**options)
        elif any(value is not None for value in options.values()):
            raise TypeError("give either a config or engine options, not both")
        num_kv_blocks = config.kv_pool_blocks(model.config, model.dtype, model.embed_tokens.device)
        runner = ModelRunner(model, num_kv_blocks=num_kv_blocks, block_size=config.block_size)
        return cls(runner, tokenizer, model_name, config)

    # ---- validation -----------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError (naming the request) if the engine cannot run it."""
        check_request(request, self.vocab_size, self.max_model_len, self.block_manager.block_size,
                      self.block_manager.num_blocks)
        if request.request_id in self._active:
            raise InvalidRequestError(request.request_id, "invalid_request",
                                      "request_id is already running in this engine", "request_id")

    # ---- generation ---------------------------------------------------------------------
    def generate(self, requests: Iterable[GenerationRequest], offline: bool = True,
                 feed: Optional[RequestFeed] = None) -> Iterator[GenerationOutput]:
        """Run `requests`; yield each one's GenerationOutput as soon as it finishes.

        Invalid requests are yielded first, as finish_reason="error" outputs. offline=True
        reorders admission so requests sharing a prompt prefix run together; False keeps
        arrival order. With a `feed`, more requests join while the others run (see RequestFeed),
        and generation ends when both are done. Closing the iterator early aborts whatever has
        not finished.
        """
        with self._lock:
            if self._generating:
                raise RuntimeError("Engine.generate() is already running; one call at a time")
            self._generating = True
        try:
            yield from self._admit(requests, offline)
            while True:
                if feed is not None:
                    idle = not self.scheduler.has_unfinished()
                    more = feed.take(len(self.scheduler.waiting), idle)
                    if more is None:
                        feed = None
                    elif more:
                        yield from self._admit(more, offline)
                    elif idle:
                        time.sleep(0.001)   # a feed that breaks its contract must not make this spin hot
                if not self.scheduler.has_unfinished():
                    if feed is None:
                        break
                    continue
                yield from self._take_aborts()
                if not self.scheduler.has_unfinished():
                    continue
                for seq in self._step():
                    yield self._finish(seq)
        finally:
            for seq in list(self._active.values()):  # iterator closed early, or an error
                self.scheduler.finish(seq)
                self._active.pop(seq.request_id, None)
            self._abort_requested.clear()
            self._generating = False

    def _admit(self, requests: Iterable[GenerationRequest], offline: bool) -> Iterator[GenerationOutput]:
        """Validate and queue requests; the invalid ones come back at once as error outputs."""
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
        seconds = time.perf_counter() - start
        self._account(scheduled, seconds)
        if self.step_listeners:
            report = StepReport(seconds, len(scheduled), sum(item.num_new_tokens for item in scheduled),
                                self.block_manager.num_used_blocks, self.block_manager.num_blocks)
            for listener in self.step_listeners:
                listener(report)
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

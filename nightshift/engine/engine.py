"""Engine: the public entry point. Validates requests, runs the step loop, yields outputs.

One step = schedule (Scheduler) -> run the model on every scheduled sequence's new
tokens (ModelRunner), while the grammar masks of the constrained ones are computed beside it
(grammar.py) -> fork the other choices of n-choice requests whose prompt was just computed
(they share its KV blocks) -> sample the sequences that reached their last token (sampler)
-> append, advance grammars, check stops, release finished sequences; a request is yielded
when all its choices are done. Each step's wall time is shared among the requests in it in
proportion to the tokens each processed, which gives every request its `engine_seconds`.
Defaults of every option: engine_config.py.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

from nightshift.engine.block_manager import BlockManager
from nightshift.engine.engine_config import EngineConfig, resolve_device, resolve_dtype
from nightshift.engine.grammar import GrammarCompiler, GrammarError, GrammarMasks, LateGrammarCheck
from nightshift.engine.kernels import cpu_prefix_attention
from nightshift.engine.loader import load_model
from nightshift.engine.model_files import model_name, resolve_model
from nightshift.engine.models import fused_cpu_layer, fused_gpu_layer
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.request_validation import check_request
from nightshift.engine.sampler import late_maskable, plain_greedy, sample
from nightshift.engine.scheduler import ScheduledSeq, Scheduler
from nightshift.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from nightshift.engine.step import StepItem
from nightshift.engine.stop_checker import StopChecker
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import (Choice, EngineStats, GenerationOutput, GenerationRequest, InvalidRequestError,
                                     RequestError, RequestFeed, StepReport)


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
        # a model whose every layer slides: blocks out of the window go back to the pool as it runs
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   window=runner.config.kv_window)
        eos = eos_token_ids if eos_token_ids is not None else list(tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self.stop_checker = StopChecker(tokenizer, eos, self.max_model_len)
        self.grammar = GrammarCompiler(tokenizer, self.vocab_size)
        self._masks: Optional[GrammarMasks] = None        # made with the first constrained request
        self._stats = EngineStats(kv_blocks_total=runner.num_kv_blocks)
        self._active: dict[str, SequenceGroup] = {}
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
                        kv_cache_bytes: Optional[int] = None, enforce_eager: Optional[bool] = None) -> "Engine":
        """Load `model` ("default", a GGUF file or a HF directory) and size the KV pool.

        quantization: "int4" (engine/quant/), "none", or a QuantConfig. dtype: None picks by device
        (resolve_dtype): bfloat16 on CUDA, float32 on every CPU, whose layers then multiply on the
        CPU math measured fastest at load (bf16 where the CPU has bf16 dot products or AMX tiles).
        A bfloat16 model instead (every tensor bfloat16, torch's layers and attention) measured
        1.42-1.46x slower on a 2-core Xeon with AMX (`bench.engine --skip-hf`, 607.4 / 582.2 against
        887.0 / 827.6 output tok/s, interleaved). The other options are EngineConfig's; None (or
        leaving one out) takes its default from there.
        """
        config = EngineConfig.of(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 block_size=block_size, num_kv_blocks=num_kv_blocks,
                                 enable_prefix_caching=enable_prefix_caching, kv_cache_bytes=kv_cache_bytes,
                                 enforce_eager=enforce_eager)
        device = resolve_device(device)
        net = load_model(model, dtype=resolve_dtype(dtype, device, cpu_default=torch.float32), device=device,
                         quant_config=resolve_quant_config(quantization), cache_dir=cache_dir)
        tokenizer = load_tokenizer(model, cache_dir=cache_dir)
        return cls.from_model(net, tokenizer, model_name(resolve_model(model)), config=config)

    @classmethod
    def from_model(cls, model, tokenizer, model_name: str, max_num_seqs: Optional[int] = None,
                   max_num_batched_tokens: Optional[int] = None, block_size: Optional[int] = None,
                   num_kv_blocks: Optional[int] = None, enable_prefix_caching: Optional[bool] = None,
                   kv_cache_bytes: Optional[int] = None, enforce_eager: Optional[bool] = None,
                   config: Optional[EngineConfig] = None) -> "Engine":
        """An engine with its own KV pool around an already loaded model (several may share one).
        Options as for from_pretrained, or a whole `config`."""
        options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, num_kv_blocks=num_kv_blocks,
                       enable_prefix_caching=enable_prefix_caching, kv_cache_bytes=kv_cache_bytes,
                       enforce_eager=enforce_eager)
        if config is None:
            config = EngineConfig.of(**options)
        elif any(value is not None for value in options.values()):
            raise TypeError("give either a config or engine options, not both")
        num_kv_blocks = config.kv_pool_blocks(model.config, model.kv_dtype, model.embed_tokens.device)
        runner = ModelRunner(model, num_kv_blocks=num_kv_blocks, block_size=config.block_size,
                             enforce_eager=config.enforce_eager)
        return cls(runner, tokenizer, model_name, config)

    @property
    def compute(self) -> str:
        """How the model computes, for logs and benchmarks: device, dtype and, for a float32 CPU
        model, its CPU math (engine/layers/cpu_math.py) and why, and whether its layers run as
        fused kernels (models/fused_cpu_layer.py) over a pool of narrower K/V, the LM head's form where
        it was chosen (cpu_math.choose_head), and whether a prefix
        its rows share is attended on AMX tiles (kernels/cpu_prefix_attention.py)."""
        model = self.runner.model
        where = f"{model.embed_tokens.device.type} {str(model.dtype).removeprefix('torch.')}"
        choice = getattr(model, "cpu_math", None)
        if model.embed_tokens.device.type == "cuda":
            fused = ", fused layers" if self.runner.attention.name == fused_gpu_layer.BACKEND and \
                getattr(model, "fused_gpu_layers", None) is not None else ""
            return f"{where}, decode steps {'eager' if self.runner.graphs is None else 'from CUDA graphs'}{fused}"
        if choice is None:
            return where
        fused = self.runner.attention.name == fused_cpu_layer.BACKEND and getattr(model, "fused_layers", None) is not None
        layers = f", fused layers, {str(self.runner.kv_dtype).removeprefix('torch.')} K/V" if fused else ""
        shape = model.config
        if self.runner.attention.name == fused_cpu_layer.BACKEND and cpu_prefix_attention.supports(
                shape.num_heads, shape.num_kv_heads, shape.head_dim, self.runner.kv_dtype):
            layers += ", shared prefixes on AMX tiles"
        int4 = getattr(model, "cpu_int4", None)
        int4 = f", INT4 layers {int4.describe()}" if int4 is not None else ""
        head = getattr(model, "cpu_head", None)       # a full-precision model's LM head (cpu_math.choose_head)
        head = f", LM head {head.describe()}" if head is not None else ""
        return f"{where}, CPU math {choice.describe()}{int4}{head}{layers}"

    # ---- validation -----------------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError (naming the request) if the engine cannot run it."""
        check_request(request, self.vocab_size, self.max_model_len, self.block_manager.block_size,
                      self.block_manager.num_blocks, self.scheduler.window, self.scheduler.max_num_batched_tokens)
        if request.request_id in self._active:
            raise InvalidRequestError(request.request_id, "invalid_request",
                                      "request_id is already running in this engine", "request_id")
        if request.sampling.n > self.scheduler.max_num_seqs:
            raise InvalidRequestError(request.request_id, "invalid_request",
                                      f"n ({request.sampling.n}) exceeds the engine's {self.scheduler.max_num_seqs} "
                                      "sequences per step", "n")
        spec = request.sampling.structured
        if spec is not None:
            try:
                self.grammar.grammar(spec)
            except GrammarError as err:
                what = "schema" if spec.kind == "json_schema" else "grammar"
                raise InvalidRequestError(request.request_id, "invalid_request",
                                          f"Invalid {what} for '{spec.param}': {err}", spec.param) from None

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
                for group in self._step():
                    yield self._finish(group)
        finally:
            for group in list(self._active.values()):  # iterator closed early, or an error
                for seq in group.seqs:
                    if seq.status is not SequenceStatus.FINISHED:
                        self.scheduler.finish(seq)
                self._active.pop(group.request_id, None)
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
            if request.sampling.structured is not None:
                seq.matcher = self.grammar.matcher(request.sampling.structured)
                if self._masks is None:
                    self._masks = GrammarMasks(self.vocab_size)
            with self._lock:
                self._active[seq.request_id] = SequenceGroup(seq)
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

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache (e.g. between benchmark runs); blocks of running requests stay."""
        with self._lock:
            if self._generating:
                raise RuntimeError("reset_prefix_cache() while generate() runs")
            self.block_manager.reset_prefix_cache()

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
            group = self._active.get(rid)
            if group is None:
                continue
            self._end_group(group, "abort")
            yield self._finish(group)

    def _end_group(self, group: SequenceGroup, reason: str) -> None:
        """Finish every choice of `group` that still runs, with `reason`."""
        for seq in group.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = reason
                seq.text = self.stop_checker.final_text(seq, drop_last=False)

    def _step(self) -> list[SequenceGroup]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            raise RuntimeError("scheduler made no progress with requests pending (engine bug)")
        items = [StepItem(item.seq.token_ids[item.start_pos:item.start_pos + item.num_new_tokens],
                          item.start_pos, item.seq.block_table, item.need_logits) for item in scheduled]
        sampled = [item.seq for item in scheduled if item.need_logits]
        pending = None
        if self._masks is not None and sampled:   # rows masked before sampling, computed beside the model
            pending = self._masks.start([s.matcher if s.matcher is not None and not late_maskable(s.sampling)
                                         else None for s in sampled])
        # a step of argmaxes only takes the logits as the LM head computes them (sampler module docstring)
        plain = all(plain_greedy(s.sampling) and s.matcher is None for s in sampled)
        logits = self.runner.execute(items, float_logits=not plain)
        self.scheduler.complete_step(scheduled)
        masks = pending.wait() if pending is not None else None
        if any(seq.forks_pending for seq in sampled):
            logits, masks = self._fork(sampled, logits, masks)
        late = None
        if self._masks is not None:   # the other constrained rows: checked after sampling
            rows = [i for i, s in enumerate(sampled) if s.matcher is not None and late_maskable(s.sampling)]
            late = LateGrammarCheck(self._masks, rows, [s.matcher for s in sampled]) if rows else None
        result = sample(logits, [s.sampling for s in sampled], [s.generator for s in sampled], sampled,
                        self.eos_token_ids, masks, late) if sampled else None

        now = time.time()
        ended: list[SequenceGroup] = []
        dead_ends = set(result.dead_ends) if result is not None else set()
        for index, seq in enumerate(sampled):
            if seq.status is SequenceStatus.FINISHED:   # another choice of its request ended it
                continue
            token = result.token_ids[index]
            seq.append_token(token, result.logprobs[index], result.top_logprobs[index])
            if seq.first_token_time is None:
                seq.first_token_time = now
            if index in dead_ends or (seq.matcher is not None and not seq.matcher.consume_token(token)):
                group = self._active[seq.request_id]
                seq.error = self._grammar_error(seq)
                self._end_group(group, "error")
                ended.append(group)
                continue
            reason = self.stop_checker.check(seq)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                group = self._active[seq.request_id]
                if group.finished:
                    ended.append(group)
        self._stats.output_tokens += len(sampled)
        seconds = time.perf_counter() - start
        self._account(scheduled, seconds)
        if self.step_listeners:
            report = StepReport(seconds, len(scheduled), sum(item.num_new_tokens for item in scheduled),
                                self.block_manager.num_used_blocks, self.block_manager.num_blocks)
            for listener in self.step_listeners:
                listener(report)
        return ended

    def _fork(self, sampled: list[Sequence], logits: torch.Tensor,
              masks: Optional[tuple[list[int], torch.Tensor]]) -> tuple[torch.Tensor, Optional[tuple]]:
        """Fork the other choices of every sampled sequence that has them pending (its prompt was
        just computed): each joins `sampled` with a copy of its parent's logits row (and grammar
        mask row), so all n choices draw their first token from the one prefill."""
        parent_rows: list[int] = []
        for row, seq in enumerate(list(sampled)):
            if not seq.forks_pending:
                continue
            children, copies = self.scheduler.fork(seq)
            self.runner.copy_blocks(copies)
            self._active[seq.request_id].seqs.extend(children)
            sampled.extend(children)
            parent_rows.extend([row] * len(children))
        index = torch.tensor(parent_rows, device=logits.device)
        logits = torch.cat([logits, logits.index_select(0, index)])
        if masks is not None:
            rows, bitmask = masks
            mask_of = {row: j for j, row in enumerate(rows)}
            extra = [(len(sampled) - len(parent_rows) + k, mask_of[row])
                     for k, row in enumerate(parent_rows) if row in mask_of]
            if extra:
                masks = (rows + [r for r, _ in extra],
                         torch.cat([bitmask, bitmask.index_select(0, torch.tensor([j for _, j in extra]))]))
        return logits, masks

    def _grammar_error(self, seq: Sequence) -> RequestError:
        spec = seq.sampling.structured
        return RequestError("invalid_request", f"The grammar of '{spec.param}' allows no further token after "
                            f"{seq.num_output_tokens - 1} generated tokens (the schema cannot be completed).",
                            spec.param)

    def _account(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Share the step's wall time by tokens processed; split it into prefill and decode."""
        total = sum(item.num_new_tokens for item in scheduled)
        decode_tokens = sum(item.num_new_tokens for item in scheduled if item.is_decode)
        for item in scheduled:
            item.seq.engine_seconds += seconds * item.num_new_tokens / total
        self._stats.num_steps += 1
        self._stats.decode_seconds += seconds * decode_tokens / total
        self._stats.prefill_seconds += seconds * (total - decode_tokens) / total

    def _finish(self, group: SequenceGroup) -> GenerationOutput:
        self._active.pop(group.request_id, None)
        first = group.seqs[0]
        cached = first.cached_prompt_tokens or 0
        self._stats.cached_prompt_tokens += cached
        self._stats.requests_finished += 1
        error = next((seq.error for seq in group.seqs if seq.error is not None), None)
        choices = [] if error is not None else [
            Choice(seq.choice_index, seq.output_token_ids, seq.text, seq.finish_reason,
                   list(seq.output_logprobs) if seq.sampling.logprobs else None,
                   list(seq.output_top_logprobs) if seq.sampling.logprobs and seq.sampling.top_logprobs else None,
                   seq.stop_string)
            for seq in group.seqs]
        starts = [seq.first_token_time for seq in group.seqs if seq.first_token_time is not None]
        return GenerationOutput(
            request_id=group.request_id,
            choices=choices,
            prompt_tokens=first.num_prompt_tokens,
            cached_prompt_tokens=cached,
            completion_tokens=sum(seq.num_output_tokens for seq in group.seqs),
            first_token_time=min(starts) if starts else None,
            finish_time=time.time(),
            engine_seconds=sum(seq.engine_seconds for seq in group.seqs),
            error=error,
        )

    def _error_output(self, request, err: InvalidRequestError) -> GenerationOutput:
        prompt = getattr(request, "prompt_token_ids", None)
        return GenerationOutput(
            request_id=err.request_id, choices=[],
            prompt_tokens=len(prompt) if isinstance(prompt, (list, tuple)) else 0,
            cached_prompt_tokens=0, completion_tokens=0, first_token_time=None, finish_time=time.time(),
            error=RequestError(err.code, err.message, err.param))

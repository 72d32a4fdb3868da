"""Grammar-constrained decoding (structured output), beside the sampler: llguidance compiles each
request's StructuredOutput for the model's tokenizer, keeps one matcher per constrained sequence,
and gives every step a token bitmask per constrained row, which the sampler applies.

Why llguidance (`python -m bench.grammar_libraries`, 256 sequences of an extraction schema on
the default model's 49,152-token vocabulary, 2-core AMD EPYC): a distinct schema costs ~1 ms
(grammars are lazy; outlines-core builds a full index per schema: 0.9-1.1 s), a step's masks
for 256 sequences ~11 ms (xgrammar 8 ms) against a ~370 ms model step, the widest JSON-schema
coverage with precise refusals of what it cannot do ("Unimplemented keys: [\"if\"]"), Lark
grammars for other formats, and no dependencies (xgrammar needs torch, transformers and
triton at run time).

One step. Most constrained rows (greedy, or temperature without top-k/top-p/min_p) are sampled
without a mask and checked after (``LateGrammarCheck``: ~8 us a token): only a row whose grammar
refuses its token gets a mask and picks again (the sampler's docstring says why that is exact).
On the standard workload that leaves most steps with few masks to compute: a full step's masks
cost ~13-18 ms of CPU for 256 sequences, which on a 2-core machine no other thread can hide.
The other constrained rows are masked before sampling: ``GrammarMasks.start`` computes their
bitmasks in a background thread (llguidance fills them in Rust, in parallel, without the GIL)
while the model runs. After sampling the engine feeds each token to its matcher. Bit ``t % 32``
of word ``t // 32`` allows token ``t``.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence as Seq

import torch

from nightshift.engine.types import STRUCTURED_KINDS, StructuredOutput

# JSON as the grammar writes it: compact, no free whitespace (a small model given free
# whitespace can spend its whole budget on newlines); the schema may not loosen this.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
CACHE_SIZE = 1024           # distinct grammars kept compiled per engine


class GrammarError(ValueError):
    """A grammar the library cannot compile, or one that reached a state with no allowed token."""


def grammar_key(spec: StructuredOutput) -> str:
    """The cache key of a spec: its kind and its canonical JSON (key order does not matter)."""
    return spec.kind + "\0" + (spec.spec if isinstance(spec.spec, str) else
                               json.dumps(spec.spec, sort_keys=True, separators=(",", ":")))


class GrammarCompiler:
    """llguidance grammars for one tokenizer, each distinct spec compiled once (LRU of CACHE_SIZE).

    The tokenizer view (~0.2-2 s to build) is made on the first constrained request, so an engine
    that never sees one never pays for it."""

    def __init__(self, tokenizer, vocab_size: int):  # noqa: ANN001 - engine.tokenizer.Tokenizer
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._grammars: OrderedDict[str, object] = OrderedDict()   # key -> grammar text, or GrammarError
        self.compiled = 0       # grammars compiled (cache misses), for tests and stats

    @property
    def ll_tokenizer(self):  # noqa: ANN201
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The checked grammar text of `spec` (cached); GrammarError with the library's reason."""
        key = grammar_key(spec)
        with self._lock:
            cached = self._grammars.get(key)
            if cached is not None:
                self._grammars.move_to_end(key)
        if cached is None:
            cached = self._compile(spec)
            with self._lock:
                self._grammars[key] = cached
                self.compiled += 1
                while len(self._grammars) > CACHE_SIZE:
                    self._grammars.popitem(last=False)
        if isinstance(cached, GrammarError):
            raise cached
        return cached

    def _compile(self, spec: StructuredOutput):  # noqa: ANN202 - str or GrammarError
        import llguidance
        if spec.kind not in STRUCTURED_KINDS:
            return GrammarError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(STRUCTURED_KINDS)})")
        try:
            if spec.kind == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            elif spec.kind == "json_schema":
                schema = json.loads(spec.spec) if isinstance(spec.spec, str) else spec.spec
                if not isinstance(schema, (dict, bool)):
                    return GrammarError("the JSON schema must be an object")
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            elif spec.kind == "lark":
                text = llguidance.LLMatcher.grammar_from_lark(str(spec.spec))
            else:
                text = llguidance.LLMatcher.grammar_from_regex(str(spec.spec))
        except (ValueError, TypeError) as exc:
            return GrammarError(str(exc))
        error = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer, limits=_limits())
        return GrammarError(_clean(error)) if error else text

    def matcher(self, spec: StructuredOutput):  # noqa: ANN201 - llguidance.LLMatcher
        """A fresh matcher for one sequence (GrammarError if the spec does not compile)."""
        import llguidance
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(spec), log_level=0, limits=_limits())
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))
        return matcher


def _limits():  # noqa: ANN202
    import llguidance
    return llguidance.LLParserLimits(verbose_errors=False)   # no parser state or grammar dumps in errors


def _clean(message: str) -> str:
    return " ".join(message.split())[:1000]


class PendingMasks:
    """The bitmasks of one step's constrained rows, being computed; ``wait()`` gives
    ``(rows, bitmask)``: the row indices (of the step's sampled sequences) and an int32
    ``[len(rows), ceil(vocab / 32)]`` tensor, one row each."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, future: Optional[Future]):
        self.rows, self.bitmask, self._future = rows, bitmask, future

    def wait(self) -> tuple[list[int], torch.Tensor]:
        if self._future is not None:
            self._future.result()
            self._future = None
        return self.rows, self.bitmask


class GrammarMasks:
    """Computes the step's bitmasks off the engine thread and advances matchers after sampling."""

    def __init__(self, vocab_size: int):
        import llguidance
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def start(self, matchers: Seq[Optional[object]]) -> Optional[PendingMasks]:
        """Begin the masks of the rows whose matcher is not None; None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32)
        pairs = [(matchers[i], j) for j, i in enumerate(rows)]
        future = self._thread.submit(self._fill, pairs, bitmask)
        return PendingMasks(rows, bitmask, future)

    def fill(self, matchers: Seq[object]) -> torch.Tensor:
        """The bitmasks of these matchers now, one row each."""
        bitmask = torch.empty((len(matchers), self.words), dtype=torch.int32)
        self._fill([(m, j) for j, m in enumerate(matchers)], bitmask)
        return bitmask

    def _fill(self, pairs: list, bitmask: torch.Tensor) -> None:
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

    def close(self) -> None:
        self._thread.shutdown(wait=False)


class LateGrammarCheck:
    """The sampler's ``late`` rows: constrained rows sampled without a mask; ``refused`` checks
    each chosen token against its matcher (without consuming it) and gives the masks of the rows
    whose token is refused, for them to pick again."""

    def __init__(self, masks: GrammarMasks, rows: list[int], matchers: Seq[object]):
        self.masks, self.rows, self.matchers = masks, rows, matchers

    def refused(self, tokens: list[int]) -> Optional[tuple[list[int], torch.Tensor]]:
        rows = [row for row, token in zip(self.rows, tokens) if not self._accepts(self.matchers[row], token)]
        if not rows:
            return None
        return rows, self.masks.fill([self.matchers[row] for row in rows])

    @staticmethod
    def _accepts(matcher, token: int) -> bool:  # noqa: ANN001
        """Whether the mask would allow `token`. Where the grammar forces the next bytes (a key, a
        closing bracket), llguidance's mask allows only their canonical tokenization (`{"` but
        not `{` then `"`), which the parser check alone would accept: such rows take the mask."""
        return not matcher.compute_ff_bytes() and matcher.validate_tokens([token]) == 1


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]`` from an int32 bitmask ``[rows, words]`` (on the bitmask's device)."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()

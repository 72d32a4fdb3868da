"""`python -m bench.grammar_libraries`: the grammar libraries we could build structured output on,
measured on our own workload: the default model's tokenizer, an extraction JSON schema, and a
batch of sequences each writing a different valid answer one token at a time.

For each library found installed (llguidance, xgrammar, outlines-core; the product depends on
llguidance only, the others are measured when present: `pip install xgrammar outlines-core`):
  - vocab: building its view of our tokenizer (once per worker);
  - compile: the first compile of a schema (once per distinct schema per worker);
  - mask: one batch step's token bitmasks for N sequences (what the sampler waits on), as the
    library's own batched call where it has one, and per sequence otherwise;
  - consume: feeding each sequence's sampled token back.
Times are the median over the answer's steps, in milliseconds per step for the whole batch.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Callable

import torch

from nightshift.engine.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "employed": {"type": "boolean"},
        "role": {"enum": ["engineer", "manager", "designer", "analyst", "other"]},
    },
    "required": ["name", "age", "email", "city", "interests", "employed", "role"],
    "additionalProperties": False,
}
NAMES = "Ada Grace Linus Guido Barbara Ken Dennis Margaret Edsger Donald Frances Alan".split()
CITIES = "Berlin Lisbon Osaka Lagos Lima Oslo Austin Pune Quito Hanoi".split()
TOPICS = "chess jazz hiking rust sailing opera pottery climbing baking astronomy".split()


def answers(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name = f"{rng.choice(NAMES)} {rng.choice(NAMES)}son"
        out.append(json.dumps({
            "name": name, "age": rng.randint(18, 90), "email": f"{name.split()[0].lower()}@example.org",
            "city": rng.choice(CITIES), "interests": rng.sample(TOPICS, rng.randint(1, 4)),
            "employed": rng.random() < 0.5, "role": rng.choice(SCHEMA["properties"]["role"]["enum"]),
        }, separators=(",", ":")))
    return out


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


class Library:
    name = ""

    def vocab(self, tokenizer, vocab_size: int) -> None: ...

    def compile(self, schema: dict): ...

    def matchers(self, compiled, count: int) -> list: ...

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None: ...

    def consume(self, matchers: list, tokens: list[int]) -> None: ...


class LLGuidance(Library):
    name = "llguidance"

    def vocab(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.torch as llt
        self.ll, self.llt = llguidance, llt
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                          eos_token=tokenizer.eos_token_ids)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        assert not error, error
        self.ll.LLMatcher(self.tok, grammar)   # the first matcher builds the lexer
        return grammar

    def matchers(self, compiled, count):
        return [self.ll.LLMatcher(self.tok, compiled) for _ in range(count)]

    def fill(self, matchers, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matchers, tokens):
        for m, t in zip(matchers, tokens):
            assert m.consume_token(t), m.get_error()


class XGrammar(Library):
    name = "xgrammar"

    def vocab(self, tokenizer, vocab_size):
        import xgrammar
        self.xgr = xgrammar
        pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(pieces, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=tokenizer.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, count):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matchers, tokens):
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t)


class OutlinesCore(Library):
    name = "outlines-core"

    def vocab(self, tokenizer, vocab_size):
        import outlines_core
        self.oc = outlines_core
        eos = tokenizer.eos_token_ids[0]
        tokens: dict[bytes, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            if i not in tokenizer.eos_token_ids:
                tokens.setdefault(tokenizer.token_bytes(i), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, compiled, count):
        return [self.oc.Guide(compiled) for _ in range(count)]

    def fill(self, matchers, bitmask):
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def consume(self, matchers, tokens):
        for g, t in zip(matchers, tokens):
            g.advance(t)


LIBRARIES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def measure(library: Library, tokenizer, vocab_size: int, batch: int, token_rows: list[list[int]]) -> dict:
    _, vocab_s = timed(lambda: library.vocab(tokenizer, vocab_size))
    compiled, compile_s = timed(lambda: library.compile(SCHEMA))
    _, recompile_s = timed(lambda: library.compile({**SCHEMA, "title": "second"}))
    matchers = library.matchers(compiled, batch)
    bitmask = torch.zeros((batch, (vocab_size + 31) // 32), dtype=torch.int32)
    steps = max(len(row) for row in token_rows)
    fills, consumes, allowed_ok = [], [], True
    live = list(range(batch))
    for step in range(steps):
        live = [i for i in live if step < len(token_rows[i])]
        if not live:
            break
        ms = [matchers[i] for i in live]
        sub = bitmask[:len(live)]
        _, t = timed(lambda: library.fill(ms, sub))
        fills.append(t)
        tokens = [token_rows[i][step] for i in live]
        for j, t_id in enumerate(tokens):   # the answer's own token must be allowed
            allowed_ok &= bool((int(sub[j, t_id // 32]) >> (t_id % 32)) & 1)
        _, t = timed(lambda: library.consume(ms, tokens))
        consumes.append(t)
    return {"library": library.name, "vocab_s": vocab_s, "compile_s": compile_s, "compile2_s": recompile_s,
            "fill_ms": 1000 * statistics.median(fills), "fill_max_ms": 1000 * max(fills),
            "consume_ms": 1000 * statistics.median(consumes), "steps": len(fills), "answers_allowed": allowed_ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="sequences per step (default 256)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    args = parser.parse_args()
    tokenizer = load_tokenizer("default")
    vocab_size = tokenizer.vocab_size
    token_rows = [tokenizer.encode(a, add_special_tokens=False) for a in answers(args.batch)]
    print(f"workload: {args.batch} sequences, an extraction schema of 7 fields, answers of "
          f"{min(map(len, token_rows))}-{max(map(len, token_rows))} tokens, vocab {vocab_size}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'library':<14} {'vocab s':>8} {'compile s':>10} {'2nd schema s':>13} {'mask ms/step':>13} "
          f"{'max':>7} {'consume ms':>11} {'answers ok':>10}")
    for name in args.libraries.split(","):
        try:
            library = LIBRARIES[name]()
            row = measure(library, tokenizer, vocab_size, args.batch, token_rows)
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc.name})")
            continue
        print(f"{row['library']:<14} {row['vocab_s']:>8.2f} {row['compile_s']:>10.3f} {row['compile2_s']:>13.3f} "
              f"{row['fill_ms']:>13.2f} {row['fill_max_ms']:>7.1f} {row['consume_ms']:>11.2f} "
              f"{str(row['answers_allowed']):>10}")


if __name__ == "__main__":
    main()

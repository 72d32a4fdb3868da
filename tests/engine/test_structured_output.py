"""Grammar-constrained decoding on the real default model: every constrained answer parses and
validates against its schema (greedy and sampled, in one continuous batch with unconstrained
requests and the prefix cache on); each distinct schema is compiled once; a schema the library
cannot compile is refused naming the request field, the others still run; a cut answer keeps
finish_reason "length"; a grammar that admits nothing ends its request with an error."""
import json

import jsonschema
import pytest

from nightshift.engine.engine import Engine
from nightshift.engine.grammar import GrammarMasks, LateGrammarCheck
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Rome", "Lisbon", "Oslo"]},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "languages", "employed"],
    "additionalProperties": False,
}
TEXTS = ["Marie is 31, lives in Paris, speaks French and German and works as a nurse.",
         "Jonas (age 45) moved to Berlin last year; he is retired and speaks only German.",
         "Ana, 27, a designer from Lisbon, speaks Portuguese, English and Spanish.",
         "Luca is 58 and runs a bakery in Rome. He speaks Italian."]
PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def engine(fp32_model, tokenizer):
    return Engine.from_model(fp32_model, tokenizer, "default", max_num_seqs=32, max_num_batched_tokens=512,
                             num_kv_blocks=512)


def prompt(tokenizer, text):
    return tokenizer.apply_chat_template([
        {"role": "system", "content": "You extract facts about people into JSON."},
        {"role": "user", "content": f"Extract the person's details as JSON.\n\n{text}"}])


def constrained(schema=PERSON, kind="json_schema", **kw):
    kw.setdefault("max_tokens", 256)
    return SamplingParams(structured=StructuredOutput(kind, schema if kind == "json_schema" else None, PARAM), **kw)


def test_every_constrained_answer_validates_greedy_and_sampled(engine, tokenizer):
    requests = []
    for i, text in enumerate(TEXTS):
        p = prompt(tokenizer, text)
        requests.append(GenerationRequest(f"greedy{i}", p, constrained(temperature=0)))
        for seed in range(3):
            requests.append(GenerationRequest(f"sampled{i}-{seed}", p, constrained(temperature=1.0, seed=seed)))
        requests.append(GenerationRequest(f"object{i}", p, constrained(kind="json_object", temperature=0, frequency_penalty=1.0)))
        requests.append(GenerationRequest(f"free{i}", p, SamplingParams(max_tokens=24, temperature=0)))
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert len(outputs) == len(requests)
    objects_done = 0
    for rid, out in outputs.items():
        if rid.startswith("free"):
            assert out.finish_reason in ("stop", "length")
            continue
        if rid.startswith("object"):
            # any JSON object: a 135M model may write one without end; what it wrote is still a
            # valid start of an object, token by token, and a finished one parses
            matcher = engine.grammar.matcher(StructuredOutput("json_object", None, PARAM))
            assert matcher.consume_tokens(out.token_ids), (rid, out.text)
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
                objects_done += 1
            continue
        assert out.finish_reason == "stop", (rid, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)
    assert objects_done >= 2
    # the prompt's shared system part came from the prefix cache for the later requests
    assert sum(o.cached_prompt_tokens > 0 for o in outputs.values()) >= len(requests) // 2


def test_each_distinct_schema_is_compiled_once(engine, tokenizer):
    reordered = json.loads(json.dumps(PERSON))
    reordered = {k: reordered[k] for k in reversed(list(reordered))}   # same schema, other key order
    other = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    before = engine.grammar.compiled
    p = prompt(tokenizer, TEXTS[0])
    requests = [GenerationRequest(f"r{i}", p, constrained(schema, temperature=0, max_tokens=8))
                for i, schema in enumerate([PERSON, reordered, PERSON, other, other])]
    list(engine.generate(requests))
    assert engine.grammar.compiled - before <= 2
    list(engine.generate(requests))
    assert engine.grammar.compiled - before <= 2


def test_uncompilable_schema_is_refused_naming_the_field_and_the_rest_run(engine, tokenizer):
    p = prompt(tokenizer, TEXTS[1])
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    unsupported = {"type": "array", "uniqueItems": True}
    requests = [GenerationRequest("bad", p, constrained(bad)), GenerationRequest("good", p, constrained(temperature=0)),
                GenerationRequest("unsupported", p, constrained(unsupported))]
    outputs = {o.request_id: o for o in engine.generate(requests)}
    for rid, reason in (("bad", "look-around"), ("unsupported", "uniqueItems")):
        assert outputs[rid].finish_reason == "error"
        assert outputs[rid].error.param == PARAM
        assert reason in outputs[rid].error.message
    jsonschema.validate(json.loads(outputs["good"].text), PERSON)


def test_cut_answer_keeps_length_and_is_a_prefix_of_the_full_one(engine, tokenizer):
    p = prompt(tokenizer, TEXTS[2])
    outputs = {o.request_id: o for o in engine.generate([
        GenerationRequest("cut", p, constrained(temperature=0, max_tokens=6)),
        GenerationRequest("full", p, constrained(temperature=0))])}
    assert outputs["cut"].finish_reason == "length" and outputs["cut"].completion_tokens == 6
    assert outputs["full"].text.startswith(outputs["cut"].text)


def test_ignore_eos_cannot_run_a_complete_grammar_past_its_end(engine, tokenizer):
    p = prompt(tokenizer, TEXTS[3])
    out = next(engine.generate([GenerationRequest("x", p, constrained(temperature=0, ignore_eos=True))]))
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)


def test_unsatisfiable_schema_is_refused_before_it_runs(engine, tokenizer):
    impossible = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                  "required": ["n"]}
    out = next(engine.generate([GenerationRequest("impossible", prompt(tokenizer, TEXTS[0]), constrained(impossible))]))
    assert out.finish_reason == "error" and out.error.param == PARAM
    assert "unsatisfiable" in out.error.message


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_k=20, seed=1)],
                         ids=["checked-after-sampling", "masked-before-sampling"])
def test_grammar_that_admits_nothing_ends_the_request_with_an_error(engine, tokenizer, monkeypatch, sampling):
    """A state with no allowed token (which the library's compile checks make rare) ends the
    request with an error naming the field, never with a token the grammar did not allow. Here
    every mask is emptied from the request's fourth token on, on both mask paths."""
    def stuck(matcher) -> bool:
        seqs = [s for g in engine._active.values() for s in g.seqs if s.matcher is matcher]
        return bool(seqs) and seqs[0].num_output_tokens >= 3

    real_fill, real_refused = GrammarMasks._fill, LateGrammarCheck.refused

    def fill(self, pairs, bitmask):
        real_fill(self, pairs, bitmask)
        for matcher, j in pairs:
            if stuck(matcher):
                bitmask[j] = 0

    def refused(self, tokens):
        found = real_refused(self, tokens)
        rows = sorted(set(found[0] if found else ()) | {r for r in self.rows if stuck(self.matchers[r])})
        return (rows, self.masks.fill([self.matchers[r] for r in rows])) if rows else None

    monkeypatch.setattr(GrammarMasks, "_fill", fill)
    monkeypatch.setattr(LateGrammarCheck, "refused", refused)
    p = prompt(tokenizer, TEXTS[0])
    outputs = {o.request_id: o for o in engine.generate([
        GenerationRequest("stuck", p, constrained(**sampling)),
        GenerationRequest("fine", p, SamplingParams(max_tokens=6, temperature=0))])}
    out = outputs["stuck"]
    assert out.finish_reason == "error" and out.error.param == PARAM
    assert "allows no further token after 3 generated tokens" in out.error.message
    assert outputs["fine"].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_checking_after_sampling_gives_the_tokens_masking_first_gives(engine, tokenizer, monkeypatch):
    """Greedy and plain-temperature rows are sampled unmasked and re-pick only when refused; that
    must give exactly the tokens that masking every row before sampling gives (same seeds)."""
    requests = [GenerationRequest(f"{kind}{i}", prompt(tokenizer, text), constrained(**params))
                for i, text in enumerate(TEXTS)
                for kind, params in (("greedy", dict(temperature=0)), ("hot", dict(temperature=1.3, seed=i)))]
    checked_after = {o.request_id: o.token_ids for o in engine.generate(requests)}
    import nightshift.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "late_maskable", lambda params: False)
    masked_first = {o.request_id: o.token_ids for o in engine.generate(requests)}
    assert checked_after == masked_first


def test_the_check_after_sampling_accepts_exactly_the_tokens_the_mask_allows(engine):
    """LateGrammarCheck's rule against llguidance's own mask, over the whole vocabulary, in states
    along random walks through two grammars (forced-byte states included)."""
    import random

    import torch
    rng = random.Random(0)
    masks = GrammarMasks(engine.vocab_size)
    compared = 0
    for spec in (StructuredOutput("json_schema", PERSON, PARAM), StructuredOutput("json_object", None, PARAM)):
        matcher = engine.grammar.matcher(spec)
        for step in range(24):
            bitmask = masks.fill([matcher])
            allowed = torch.nonzero(
                ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:engine.vocab_size]
            ).flatten().tolist()
            if step % 6 == 0:
                accepted = [t for t in range(engine.vocab_size) if LateGrammarCheck._accepts(matcher, t)]
                forced = bool(matcher.compute_ff_bytes())
                assert accepted == ([] if forced else allowed), (spec.kind, step)
                compared += 1
            assert matcher.consume_token(rng.choice(allowed))
            if matcher.is_stopped():
                break
    assert compared >= 6

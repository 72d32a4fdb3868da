"""n choices on the real default model: one prefill shared by all choices (their prompt blocks
shared, the partial last block copied), every block freed exactly once, choice i of a seeded
request equal to a lone request seeded seed + i whatever the batch, forks under a full KV pool;
and penalties and logit bias in greedy decoding equal to transformers' generate()."""
import pytest
import torch

from nightshift.engine.engine import Engine
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def make_engine(model, tokenizer, **config):
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("max_num_seqs", 32)
    config.setdefault("max_num_batched_tokens", 256)
    return Engine.from_model(model, tokenizer, "default", **config)


def prompt(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def by_id(outputs):
    return {o.request_id: o for o in outputs}


def test_n_greedy_choices_share_one_prefill_and_equal_a_lone_request(fp32_model, tokenizer):
    engine = make_engine(fp32_model, tokenizer)
    p = prompt(tokenizer, "Write one sentence about lighthouses.")
    assert len(p) % engine.block_manager.block_size != 0          # the last prompt block is partial: copied
    tokens_run = []
    engine.step_listeners.append(lambda report: tokens_run.append(report.tokens))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = next(engine.generate([GenerationRequest("n4", p, SamplingParams(**{**vars(params), "n": 4}))]))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert sum(tokens_run) == len(p) + 4 * 11                     # the prompt once, then each choice's decodes
    assert out.prompt_tokens == len(p) and out.completion_tokens == 4 * 12
    alone = next(engine.generate([GenerationRequest("n1", p, params)]))
    for choice in out.choices:
        assert choice.token_ids == alone.token_ids and choice.finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0              # every reference dropped exactly once


def test_seeded_choice_i_equals_a_lone_request_seeded_seed_plus_i(fp32_model, tokenizer):
    engine = make_engine(fp32_model, tokenizer)
    p = prompt(tokenizer, "Name a colour and a fruit.")
    other = prompt(tokenizer, "Count to five.")
    sampled = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    outputs = by_id(engine.generate([
        GenerationRequest("n3", p, SamplingParams(n=3, seed=40, **sampled)),
        GenerationRequest("noise", other, SamplingParams(n=2, **sampled)),
        GenerationRequest("greedy", other, SamplingParams(max_tokens=5, temperature=0))]))
    choices = [c.token_ids for c in outputs["n3"].choices]
    assert len({tuple(c) for c in choices}) == 3                  # really three different draws
    for i, tokens in enumerate(choices):
        alone = next(make_engine(fp32_model, tokenizer).generate(
            [GenerationRequest("x", p, SamplingParams(seed=40 + i, **sampled))]))
        assert alone.token_ids == tokens, i


def test_forks_wait_for_blocks_when_the_pool_is_full_and_still_match(fp32_model, tokenizer):
    """A long request B holds most of a small pool when the n=6 request A's prompt is computed: three
    forks get their copy of the last prompt block at once, the other two wait for blocks and then
    recompute their prompt from the prefix cache; all six choices are still the greedy answer."""
    a = prompt(tokenizer, "Describe a quiet harbour at dawn in a few words.")      # 41 tokens: 3 blocks
    b = tokenizer.encode(" ".join(["harbour"] * 99), add_special_tokens=False)[:100]
    assert len(a) == 41 and len(b) == 100
    engine = make_engine(fp32_model, tokenizer, num_kv_blocks=7 + 3 + 3, max_num_batched_tokens=16)
    tokens_run = []
    engine.step_listeners.append(lambda report: tokens_run.append(report.tokens))
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = by_id(engine.generate([GenerationRequest("B", b, SamplingParams(**params)),
                                     GenerationRequest("A", a, SamplingParams(n=6, **params))], offline=False))
    alone = next(make_engine(fp32_model, tokenizer).generate([GenerationRequest("x", a, SamplingParams(**params))]))
    assert len(outputs["A"].choices) == 6
    assert all(c.token_ids == alone.token_ids for c in outputs["A"].choices)
    all_forked = len(b) + 7 + len(a) + 6 * 7
    # two forks recomputed the 10 tokens after the cached blocks (prompt tail + first token) in
    # place of one decode each
    assert sum(tokens_run) == all_forked + 2 * (42 - 32 - 1)
    assert engine.block_manager.num_used_blocks == 0


def test_constrained_choices_each_follow_the_grammar(fp32_model, tokenizer):
    engine = make_engine(fp32_model, tokenizer)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    out = next(engine.generate([GenerationRequest("c", prompt(tokenizer, "Pick a colour and a number as JSON."),
                                                  SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=40,
                                                                 structured=StructuredOutput("json_schema", schema)))]))
    import json
    import jsonschema
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)


def test_aborting_an_n_request_frees_every_choice(fp32_model, tokenizer):
    engine = make_engine(fp32_model, tokenizer)
    p = prompt(tokenizer, "Tell me a long story.")
    steps = []

    def abort_after_a_few_steps(report):
        steps.append(report)
        if len(steps) == 4:
            assert engine.abort("long")

    engine.step_listeners.append(abort_after_a_few_steps)
    out = next(engine.generate([GenerationRequest("long", p, SamplingParams(n=3, max_tokens=200, ignore_eos=True,
                                                                             temperature=0))]))
    assert out.finish_reason == "abort" and len(out.choices) == 3
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 4 for c in out.choices)
    assert engine.block_manager.num_used_blocks == 0


@torch.inference_mode()
def test_penalties_and_bias_in_greedy_decoding_equal_transformers(fp32_model, tokenizer, hf_reference_model):
    """transformers' generate() with repetition_penalty and sequence_bias (its logit bias) against
    ours on the same weights, token for token."""
    engine = make_engine(fp32_model, tokenizer)
    texts = ["List three animals.", "Say hello twice.", "What is two plus two?"]
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    requests, refs = [], []
    for i, text in enumerate(texts):
        p = prompt(tokenizer, text)
        requests.append(GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                                     repetition_penalty=1.3,
                                                                     logit_bias={comma: -5.0})))
        ref = hf_reference_model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                          repetition_penalty=1.3, sequence_bias={(comma,): -5.0},
                                          attention_mask=torch.ones(1, len(p), dtype=torch.long))
        refs.append(ref[0, len(p):].tolist())
    outputs = by_id(engine.generate(requests))
    equal = sum(outputs[f"r{i}"].token_ids == ref for i, ref in enumerate(refs))
    assert equal == len(texts), [(outputs[f"r{i}"].token_ids, ref) for i, ref in enumerate(refs)]

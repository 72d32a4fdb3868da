"""Greedy output equals HF transformers' token for token, with every engine feature on.

Our engine (float32) runs all prompts in ONE generate call: paged KV, continuous
batching over mixed prompt lengths, chunked prefill (a small max_num_batched_tokens
splits the long prompts) and the prefix cache (several prompts share a system prompt).
The reference is transformers' own greedy decoding of each prompt alone, on the same
GGUF weights. Near-tie rule: at a position where the reference's top two logits are
within 1e-3, float32 rounding in either implementation (a different summation order) can
swap them, so that position and the rest of the prompt are not compared;
at least 15 of 16 prompts must be equal in full. The same comparison holds for the
prefix cache off, and for each prompt run alone.
"""
import pytest
import torch

from nightshift.engine.engine import Engine
from bench.greedy_check import default_prompts   # the one prompt set (also used on GPU)
from nightshift.engine.model_files import model_name, resolve_model
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
NEAR_TIE = 1e-3
MAX_BATCHED_TOKENS = 48       # smaller than most prompts: they are prefilled in chunks


@pytest.fixture(scope="module")
def prompts():
    return default_prompts(load_tokenizer("default"))


@torch.inference_mode()
def hf_greedy(model, prompt):
    """transformers' greedy continuation of one prompt, with the logits of each step."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(NEW_TOKENS):
        step_logits = out.logits[0, -1].float()
        token = int(step_logits.argmax())
        tokens.append(token)
        logits.append(step_logits)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def reference(hf_reference_model, prompts):
    refs = [hf_greedy(hf_reference_model, p) for p in prompts]
    tokens = [t for t, _ in refs]
    cuts = []
    for _, logits in refs:
        top2 = logits.topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE).nonzero().flatten().tolist()
        cuts.append(ties[0] if ties else NEW_TOKENS)
    return tokens, cuts


def run_engine(fp32_model, requests, **config):
    engine = Engine.from_model(fp32_model, load_tokenizer("default"), model_name(resolve_model("default")),
                               max_num_batched_tokens=MAX_BATCHED_TOKENS, num_kv_blocks=512, **config)
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert all(o.finish_reason == "length" for o in outputs.values())
    return outputs, engine.stats()


def requests_for(prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [GenerationRequest(f"p{i}", p, params) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def batched(fp32_model, prompts):
    return run_engine(fp32_model, requests_for(prompts), max_num_seqs=32, enable_prefix_caching=True)


def assert_matches(outputs, reference_tokens, cuts, label):
    full = 0
    for i, (ref, cut) in enumerate(zip(reference_tokens, cuts)):
        ours = outputs[f"p{i}"].token_ids
        assert len(ours) == NEW_TOKENS
        assert ours[:cut] == ref[:cut], f"{label}: prompt {i} differs before any near-tie (cut at {cut})"
        full += cut == NEW_TOKENS
    assert full >= len(cuts) - 1, f"{label}: only {full} of {len(cuts)} prompts compared in full"


def test_setup_exercises_every_feature(prompts, batched):
    outputs, stats = batched
    assert len(prompts) >= 16
    assert len({len(p) for p in prompts}) >= 12                       # mixed lengths
    assert sum(len(p) > MAX_BATCHED_TOKENS for p in prompts) >= 8      # chunked prefill
    assert sum(o.cached_prompt_tokens > 0 for o in outputs.values()) >= 7  # prefix cache hits
    assert stats.num_steps < len(prompts) * NEW_TOKENS / 4             # really batched


def test_greedy_equals_hf_with_batching_chunking_and_prefix_cache(batched, reference):
    assert_matches(batched[0], *reference, "engine (batch of all, prefix cache on)")


def test_prefix_cache_off_gives_the_same_tokens(fp32_model, prompts, batched, reference):
    outputs, stats = run_engine(fp32_model, requests_for(prompts), max_num_seqs=32, enable_prefix_caching=False)
    assert stats.cached_prompt_tokens == 0
    assert_matches(outputs, *reference, "prefix cache off")
    _, cuts = reference
    for i, cut in enumerate(cuts):
        assert outputs[f"p{i}"].token_ids[:cut] == batched[0][f"p{i}"].token_ids[:cut]


def test_batch_of_one_gives_the_same_tokens(fp32_model, prompts, batched, reference):
    requests = requests_for(prompts)
    engine = Engine.from_model(fp32_model, load_tokenizer("default"), "m", max_num_batched_tokens=MAX_BATCHED_TOKENS,
                               num_kv_blocks=64, max_num_seqs=1, enable_prefix_caching=False)
    outputs = {}
    for request in requests:
        outputs.update({o.request_id: o for o in engine.generate([request])})
    assert_matches(outputs, *reference, "batch of one")
    _, cuts = reference
    for i, cut in enumerate(cuts):
        assert outputs[f"p{i}"].token_ids[:cut] == batched[0][f"p{i}"].token_ids[:cut]

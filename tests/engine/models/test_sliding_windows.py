"""Sliding windows done right (issue 24, item 3), against transformers float32.

* A model whose every layer slides (Mistral's sliding_window; Qwen2's use_sliding_window with
  max_window_layers 0) gives its blocks out of the window back to the pool while it runs
  (Scheduler.complete_step -> BlockManager.release_before): a long prompt plus 64 generated
  tokens matches transformers (greedy tokens, and each token's logprob), and the sequence holds
  at most ceil(window / block_size) + 1 blocks while it decodes; several such sequences fit
  together in a pool that could not hold them whole; a later prompt sharing a long prefix
  reuses the released (still cached) blocks and still matches.
* A model with global layers among its window layers (Gemma 2) gives nothing back (a global
  layer reads every position), and the prefix cache stays exact: a second request sharing a
  prefix much longer than the window gives the same logprobs as without the cache.
"""
from __future__ import annotations

import math

import pytest
import torch

from model_check import VOCAB, hf_greedy, prompt, randomize_norms, save
from nightshift.engine.block_manager import RELEASED, BlockManager
from nightshift.engine.engine import Engine
from nightshift.engine.loader import load_model
from nightshift.engine.model_config import ModelConfig
from nightshift.engine.sequence import Sequence
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

WINDOW = 12
BLOCK = 4
NEW = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=0))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=2,
                                          head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                          attn_implementation="eager"))


def build(make, folder):
    torch.manual_seed(0)
    reference = make().eval()
    randomize_norms(reference)
    with torch.no_grad():      # larger q/k: attention peaks, so a wrong window changes the tokens
        for layer in reference.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return reference, load_model(save(reference, folder), cpu_math="float32")


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def all_window(request, tmp_path_factory):
    return build({"mistral": mistral, "qwen2": qwen2}[request.param], tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return build(gemma2, tmp_path_factory.mktemp("gemma2"))


@torch.inference_mode()
def hf_logprobs(reference, ids: list[int], new_tokens: int = NEW) -> tuple[list[int], list[float]]:
    tokens, logits, _ = hf_greedy(reference, ids, new_tokens)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, chosen.tolist()


def engine(model, num_kv_blocks: int, prefix_cache: bool = True, max_num_seqs: int = 8) -> Engine:
    return Engine.from_model(model, load_tokenizer("default"), "tiny", max_num_batched_tokens=32, block_size=BLOCK,
                             num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                             enable_prefix_caching=prefix_cache)


def run(eng: Engine, prompts: list[list[int]], new_tokens: int = NEW):
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=True)
    requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outputs = {o.request_id: o for o in eng.generate(requests, offline=False)}
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def assert_matches(output, expected: tuple[list[int], list[float]], what: str) -> None:
    tokens, logprobs = expected
    assert output.token_ids == tokens, f"{what}: greedy tokens differ from transformers"
    diff = max(abs(a - b) for a, b in zip(output.logprobs, logprobs))
    assert diff < 1e-4, f"{what}: logprobs differ from transformers by {diff:.2e}"


def test_config_windows():
    base = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 100, "max_position_embeddings": 4096}
    mis = ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 32})
    assert mis.max_position_embeddings == 4096 and mis.kv_window == 32          # a window, not a context cap
    assert ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": None}).kv_window is None
    q2 = {**base, "model_type": "qwen2", "sliding_window": 32}
    assert ModelConfig.from_hf_config(q2).layer_window(0) is None               # use_sliding_window off
    part = ModelConfig.from_hf_config({**q2, "use_sliding_window": True, "max_window_layers": 1})
    assert [part.layer_window(i) for i in range(3)] == [None, 32, 32] and part.kv_window is None
    assert ModelConfig.from_hf_config({**q2, "use_sliding_window": True, "max_window_layers": 0}).kv_window == 32
    gemma = ModelConfig.from_hf_config({**base, "model_type": "gemma2", "sliding_window": 8})
    assert gemma.layer_window(0) == 8 and gemma.kv_window is None               # global layers read everything


def test_all_window_model_gives_blocks_back_and_matches_hf(all_window):
    reference, ours = all_window
    assert ours.config.kv_window == WINDOW
    ids = prompt(100, 7)
    expected = hf_logprobs(reference, ids)
    eng = engine(ours, num_kv_blocks=64)
    held: list[int] = []
    eng.step_listeners.append(lambda report: held.append(report.kv_blocks_used))
    [out] = run(eng, [ids])
    assert_matches(out, expected, "all-window model, blocks given back")
    total_blocks = math.ceil((len(ids) + NEW) / BLOCK)                          # 41 without giving any back
    bound = math.ceil(WINDOW / BLOCK) + 1
    # the step listener sees the pool after each step: while decoding, one sequence holds its window's blocks
    decode_steps = held[-(NEW - 1):]
    assert max(decode_steps) <= bound, f"held {max(decode_steps)} blocks while decoding, bound {bound}"
    assert max(held) <= math.ceil((WINDOW - 1 + 32) / BLOCK) + 1 < total_blocks     # a 32-token chunk's
    assert eng.scheduler.num_released_blocks >= total_blocks - bound
    assert eng.block_manager.num_free_blocks == 64                              # all back once it ended


def test_all_window_sequences_share_a_pool_too_small_for_them_whole(all_window):
    """Four sequences of 41 blocks each in a pool of 48 run side by side with no preemption, their
    released blocks reused by the others (evicted from the prefix cache first), all matching HF."""
    reference, ours = all_window
    prompts = [prompt(100, 20 + i) for i in range(4)]
    expected = [hf_logprobs(reference, p) for p in prompts]
    eng = engine(ours, num_kv_blocks=48)
    outputs = run(eng, prompts)
    for i, (out, exp) in enumerate(zip(outputs, expected)):
        assert_matches(out, exp, f"sequence {i}")
    assert eng.stats().num_preemptions == 0
    assert eng.stats().num_steps < 4 * (NEW + 4), "the sequences did not run together"


def test_all_window_prefix_cache_reuses_released_blocks(all_window):
    """A later prompt sharing a 96-token prefix with one that already ran (its blocks released
    to the prefix cache while it ran) is served from the cache and still matches HF; so is the
    same prompt again, and one that shares only the first blocks."""
    reference, ours = all_window
    shared = prompt(96, 40)
    first, second, third = shared + prompt(9, 41), shared + prompt(5, 42), shared[:20] + prompt(30, 43)
    eng = engine(ours, num_kv_blocks=64)
    for ids, name in ((first, "first"), (second, "second"), (first, "first again"), (third, "third")):
        [out] = run(eng, [ids], new_tokens=16)
        assert_matches(out, hf_logprobs(reference, ids, 16), name)
        if name != "first":
            assert out.cached_prompt_tokens >= (20 if name == "third" else 96), name


def test_all_window_request_longer_than_the_pool_runs_and_one_it_cannot_hold_is_refused(all_window):
    """Admission counts the blocks a sequence holds at once, not its whole history: a 164-token
    request (41 blocks) runs in a pool of 12 (a 32-token chunk over the window: ceil((12 - 1 + 32)
    / 4) + 1 = 12 blocks) and matches HF; a pool of 11 refuses it, naming the window. A prompt
    whose cached prefix (11 blocks) and first chunk (5 more) exceed that pool runs on the cache:
    the prefix's blocks before the window enter its table released, never taken (taking them all,
    it would wait forever for blocks)."""
    from nightshift.engine.request_validation import kv_blocks_needed
    from nightshift.engine.types import InvalidRequestError
    reference, ours = all_window
    ids = prompt(100, 8)
    assert kv_blocks_needed(100, NEW, 1, BLOCK, WINDOW, 32) == 12 < math.ceil((100 + NEW) / BLOCK)
    eng = engine(ours, num_kv_blocks=12)
    [out] = run(eng, [ids])
    assert_matches(out, hf_logprobs(reference, ids), "a request longer than the pool")
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="window: 12 tokens.*12 KV blocks.*only 11"):
        engine(ours, num_kv_blocks=11).validate(GenerationRequest("big", ids, params))

    eng = engine(ours, num_kv_blocks=12)
    run(eng, [ids[:44]], new_tokens=1)                  # leaves its 11 full blocks in the prefix cache
    [cached] = run(eng, [ids[:64]], new_tokens=16)
    assert cached.cached_prompt_tokens == 44
    assert_matches(cached, hf_logprobs(reference, ids[:64], 16), "a prompt on a cached prefix")


def test_released_blocks_are_not_offered_unless_their_whole_chain_is_cached():
    """BlockManager level: released blocks keep their hash while cached; once one is evicted (and
    its block reused), no later block of that chain is offered as a prefix hit."""
    bm = BlockManager(num_blocks=12, block_size=4)
    request = GenerationRequest("a", list(range(1, 30)), SamplingParams(max_tokens=4))
    seq = Sequence(request, 4)
    bm.allocate_prefix(seq, bm.match_prefix(seq))
    assert bm.allocate_slots(seq, 29)
    seq.num_computed_tokens = 29
    bm.register_computed_blocks(seq)
    assert bm.release_before(seq, 29 - 8 + 1) == 5 and seq.block_table[:5] == [RELEASED] * 5
    assert bm.num_held_blocks(seq) == 3 and bm.num_free_blocks == 12 - 3
    again = Sequence(GenerationRequest("b", list(range(1, 30)), SamplingParams(max_tokens=4)), 4)
    assert len(bm.match_prefix(again)) == 7                         # released, cached, intact: a hit
    # a newcomer takes the uncached free blocks, then evicts the released ones, oldest first: block 0 of the chain
    other = Sequence(GenerationRequest("c", list(range(100, 120)), SamplingParams(max_tokens=4)), 4)
    bm.allocate_prefix(other, [])
    assert bm.allocate_slots(other, 4 * 5)
    assert bm.match_prefix(again) == []                             # the chain's first block is gone
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 12 and all(b.ref_count == 0 for b in bm.blocks)


def test_mixed_window_and_global_layers_keep_every_block_and_the_prefix_cache_exact(mixed):
    reference, ours = mixed
    assert ours.config.kv_window is None and ours.config.layer_window(0) == WINDOW
    shared = prompt(60, 50)                                         # five windows long
    prompts = [shared + prompt(7, 51), shared + prompt(11, 52)]
    expected = [hf_logprobs(reference, p, 24) for p in prompts]
    results = {}
    for prefix_cache in (True, False):
        eng = engine(ours, num_kv_blocks=96, prefix_cache=prefix_cache)
        held: list[int] = []
        eng.step_listeners.append(lambda report: held.append(report.kv_blocks_used))
        outputs = [run(eng, [p], new_tokens=24)[0] for p in prompts]    # one after the other
        assert eng.scheduler.window is None and eng.scheduler.num_released_blocks == 0
        assert max(held) == math.ceil((len(prompts[1]) + 23) / BLOCK)   # every block held to the last step
        for i, (out, exp) in enumerate(zip(outputs, expected)):
            assert_matches(out, exp, f"prompt {i}, prefix cache {prefix_cache}")
        results[prefix_cache] = outputs
    assert results[True][1].cached_prompt_tokens >= 60 and results[False][1].cached_prompt_tokens == 0
    assert max(abs(a - b) for a, b in zip(results[True][1].logprobs, results[False][1].logprobs)) < 1e-5

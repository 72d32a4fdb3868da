"""Engine on the real default model: bad requests, stats, abort, stop strings/tokens, seeds."""
import threading

import pytest

from nightshift.engine.engine import Engine
from nightshift.engine.model_files import model_name, resolve_model
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def make_engine(fp32_model, tokenizer):
    def make(**config):
        config.setdefault("num_kv_blocks", 256)
        return Engine.from_model(fp32_model, tokenizer, model_name(resolve_model("default")), **config)
    return make


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(max_num_seqs=16, max_num_batched_tokens=256)


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def by_id(outputs):
    return {o.request_id: o for o in outputs}


BAD_REQUESTS = [
    ("empty", [], greedy(4), "invalid_request", "prompt"),
    ("vocab", [1, 10 ** 9], greedy(4), "invalid_request", "prompt"),
    ("zero-tokens", [1, 2], greedy(0), "invalid_request", "max_tokens"),
    ("too-long", [1] * 8000, greedy(500), "context_length_exceeded", "max_tokens"),
    ("neg-temp", [1, 2], SamplingParams(temperature=-1.0), "invalid_request", "temperature"),
    ("str-temp", [1, 2], SamplingParams(temperature="hot"), "invalid_request", "temperature"),
    ("top-p", [1, 2], SamplingParams(top_p=0.0), "invalid_request", "top_p"),
    ("top-k", [1, 2], SamplingParams(top_k=-5), "invalid_request", "top_k"),
    ("stop", [1, 2], SamplingParams(stop=[""]), "invalid_request", "stop"),
    ("stop-ids", [1, 2], SamplingParams(stop_token_ids=[-1]), "invalid_request", "stop_token_ids"),
    ("seed", [1, 2], SamplingParams(seed="abc"), "invalid_request", "seed"),
    ("seed-range", [1, 2], SamplingParams(seed=2**64 - 2, n=3), "invalid_request", "seed"),
    ("n", [1, 2], SamplingParams(n=0), "invalid_request", "n"),
    ("many-n", [1, 2], SamplingParams(n=129), "invalid_request", "n"),
    ("min-p", [1, 2], SamplingParams(min_p=1.5), "invalid_request", "min_p"),
    ("min-tokens", [1, 2], SamplingParams(max_tokens=4, min_tokens=5), "invalid_request", "min_tokens"),
    ("top-logprobs", [1, 2], SamplingParams(top_logprobs=21), "invalid_request", "top_logprobs"),
    ("presence", [1, 2], SamplingParams(presence_penalty=2.5), "invalid_request", "presence_penalty"),
    ("repetition", [1, 2], SamplingParams(repetition_penalty=0.0), "invalid_request", "repetition_penalty"),
    ("bias-token", [1, 2], SamplingParams(logit_bias={10 ** 9: 1.0}), "invalid_request", "logit_bias"),
    ("bias-value", [1, 2], SamplingParams(logit_bias={5: 101.0}), "invalid_request", "logit_bias.5"),
    ("structured", [1, 2], SamplingParams(structured="json"), "invalid_request", "structured"),
]


@pytest.mark.parametrize("rid,prompt,params,code,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_validate_names_the_request_and_field(engine, rid, prompt, params, code, param):
    with pytest.raises(InvalidRequestError) as info:
        engine.validate(GenerationRequest(rid, prompt, params))
    assert info.value.request_id == rid and info.value.code == code and info.value.param == param
    assert rid in str(info.value)


def test_bad_requests_are_yielded_as_errors_and_never_stop_the_batch(engine, tokenizer):
    good = [GenerationRequest(f"good{i}", chat(tokenizer, f"Count to {i}."), greedy(3)) for i in range(3)]
    bad = [GenerationRequest(rid, prompt, params) for rid, prompt, params, _, _ in BAD_REQUESTS]
    outputs = by_id(engine.generate(bad[:5] + good + bad[5:]))
    assert len(outputs) == len(good) + len(bad)
    for rid, _, _, code, param in BAD_REQUESTS:
        out = outputs[rid]
        assert out.finish_reason == "error" and out.error.code == code and out.error.param == param
        assert out.token_ids == [] and out.completion_tokens == 0
    for req in good:
        assert outputs[req.request_id].finish_reason == "length"
        assert outputs[req.request_id].completion_tokens == 3


def test_request_larger_than_the_whole_kv_pool_is_an_error(make_engine):
    small = make_engine(num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=64)  # 64 token slots
    outputs = by_id(small.generate([GenerationRequest("big", list(range(100, 160)), greedy(8)),
                                    GenerationRequest("fits", list(range(100, 140)), greedy(8))]))
    assert outputs["big"].finish_reason == "error"
    assert outputs["big"].error.code == "context_length_exceeded" and "KV" in outputs["big"].error.message
    assert outputs["fits"].finish_reason == "length"


def test_stats_timing_and_prefix_cache_accounting(make_engine, tokenizer):
    eng = make_engine(max_num_seqs=8, max_num_batched_tokens=512)
    system = "You are a careful assistant who answers in one short sentence. " * 4
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": f"Name a colour number {i}."}])
               for i in range(4)]
    requests = [GenerationRequest(f"r{i}", p, greedy(4, ignore_eos=True)) for i, p in enumerate(prompts)]
    outputs = list(eng.generate(requests))
    stats = eng.stats()
    assert stats.requests_finished == 4 and stats.output_tokens == 16
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.kv_blocks_total == 256 and stats.kv_blocks_used == 0
    assert stats.num_steps >= 4 and stats.prefill_seconds > 0 and stats.decode_seconds > 0
    # the shared system prompt is computed once: the three followers hit the cache
    shared_blocks = min(len(p) for p in prompts) // 16
    hits = sorted(o.cached_prompt_tokens for o in outputs)
    assert hits[0] == 0 and all(h >= (shared_blocks - 1) * 16 for h in hits[1:])
    assert stats.cached_prompt_tokens == sum(hits)
    for out in outputs:
        assert out.prompt_tokens == len(prompts[int(out.request_id[1:])])
        assert out.first_token_time <= out.finish_time and out.engine_seconds > 0
    # the requests' shares add up to the engine's step time
    total = stats.prefill_seconds + stats.decode_seconds
    assert sum(o.engine_seconds for o in outputs) == pytest.approx(total, rel=1e-6)


def test_outputs_stream_as_each_request_finishes(engine, tokenizer):
    prompt = chat(tokenizer, "Tell me a story.")
    requests = [GenerationRequest("long", prompt, greedy(12, ignore_eos=True)),
                GenerationRequest("short", prompt, greedy(2, ignore_eos=True))]
    stream = engine.generate(requests)
    first = next(stream)
    assert first.request_id == "short"
    assert engine.stats().kv_blocks_used > 0          # "long" is still running
    rest = list(stream)
    assert [o.request_id for o in rest] == ["long"] and rest[0].completion_tokens == 12


def test_abort_while_generating(engine, tokenizer):
    prompt = chat(tokenizer, "Write a long poem about the sea.")
    requests = [GenerationRequest("long", prompt, greedy(200, ignore_eos=True)),
                GenerationRequest("short", prompt, greedy(2, ignore_eos=True)),
                GenerationRequest("queued", prompt, greedy(5, ignore_eos=True))]
    seen = []
    for out in engine.generate(requests):
        seen.append(out)
        if out.request_id == "short":
            assert engine.abort("long") and engine.abort("queued")
    outputs = by_id(seen)
    assert outputs["long"].finish_reason == "abort" and 2 <= outputs["long"].completion_tokens < 200
    assert outputs["queued"].finish_reason in ("abort", "length")
    assert not engine.abort("long")                     # no longer active
    assert engine.stats().kv_blocks_used == 0


def test_abort_from_another_thread(engine, tokenizer):
    prompt = chat(tokenizer, "Describe a mountain.")
    started = threading.Event()
    stream = engine.generate([GenerationRequest("slow", prompt, greedy(300, ignore_eos=True))])

    def abort_soon():
        started.wait()
        engine.abort("slow")
    thread = threading.Thread(target=abort_soon)
    thread.start()
    original = engine._step

    def step_and_signal():
        finished = original()
        started.set()
        return finished
    engine._step = step_and_signal
    try:
        outputs = list(stream)
    finally:
        del engine._step
        thread.join()
    assert outputs[0].finish_reason == "abort" and outputs[0].completion_tokens < 300


def test_closing_the_stream_early_frees_everything(engine, tokenizer):
    prompt = chat(tokenizer, "Hello!")
    stream = engine.generate([GenerationRequest("a", prompt, greedy(1)),
                              GenerationRequest("b", prompt, greedy(50, ignore_eos=True))])
    next(stream)
    stream.close()
    assert engine.stats().kv_blocks_used == 0
    again = list(engine.generate([GenerationRequest("b", prompt, greedy(1))]))
    assert again[0].finish_reason == "length"


def test_eos_stops_unless_ignored(engine, tokenizer):
    prompt = chat(tokenizer, "What is the capital of France?")
    out = next(engine.generate([GenerationRequest("eos", prompt, greedy(40))]))
    assert out.finish_reason == "stop" and out.token_ids[-1] in tokenizer.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    out = next(engine.generate([GenerationRequest("no-eos", prompt, greedy(n + 3, ignore_eos=True))]))
    assert out.finish_reason == "length" and out.completion_tokens == n + 3


def test_stop_token_ids_and_stop_strings(engine, tokenizer):
    prompt = chat(tokenizer, "List five fruits, separated by commas.")
    full = next(engine.generate([GenerationRequest("full", prompt, greedy(24, ignore_eos=True))]))
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    out = next(engine.generate([GenerationRequest("tok", prompt, greedy(24, stop_token_ids=[stop_token]))]))
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    assert out.text == tokenizer.decode(full.token_ids[:first])

    cut = len(full.text) // 2
    stop = full.text[cut:cut + 4]
    index = full.text.index(stop)
    out = next(engine.generate([GenerationRequest("str", prompt, greedy(24, stop=["zzzq", stop]))]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:index]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    assert out.choices[0].stop_string == stop           # which one ended it (Anthropic's stop_sequence)
    assert full.choices[0].stop_string is None


def test_same_seed_same_output_whatever_the_batch(make_engine, tokenizer):
    eng = make_engine(max_num_seqs=8, max_num_batched_tokens=128)
    prompt = chat(tokenizer, "Invent a name for a cat.")

    def seeded(rid, seed):
        return GenerationRequest(rid, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=seed,
                                                             ignore_eos=True))
    alone = next(eng.generate([seeded("x", 7)]))
    others = [GenerationRequest(f"o{i}", chat(tokenizer, f"Say {i}"), SamplingParams(max_tokens=6, temperature=1.0))
              for i in range(5)]
    batched = by_id(eng.generate(others[:2] + [seeded("x", 7), seeded("y", 8)] + others[2:]))
    assert batched["x"].token_ids == alone.token_ids
    assert batched["y"].token_ids != alone.token_ids


def test_logprobs_of_chosen_tokens(engine, tokenizer):
    prompt = chat(tokenizer, "Say hi.")
    out = next(engine.generate([GenerationRequest("lp", prompt, greedy(5, logprobs=True, ignore_eos=True))]))
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    plain = next(engine.generate([GenerationRequest("nolp", prompt, greedy(5, ignore_eos=True))]))
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_one_generate_at_a_time(engine, tokenizer):
    prompt = chat(tokenizer, "Hi")
    stream = engine.generate([GenerationRequest("a", prompt, greedy(3))])
    next(stream)
    with pytest.raises(RuntimeError):
        next(engine.generate([GenerationRequest("b", prompt, greedy(1))]))
    stream.close()


class ListFeed:
    """Hands its parts to the engine one per call while the engine is busy with fewer than
    `low_water` waiting sequences; records what the engine told it."""

    def __init__(self, parts, low_water=1):
        self.parts = list(parts)
        self.low_water = low_water
        self.calls = []

    def take(self, waiting, idle):
        self.calls.append((waiting, idle))
        if not self.parts:
            return None
        if idle or waiting < self.low_water:
            return self.parts.pop(0)
        return []


def test_a_feed_streams_requests_into_a_running_generate(engine, tokenizer):
    prompts = [chat(tokenizer, f"Name a colour, number {i}.") for i in range(6)]
    requests = [GenerationRequest(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts)]
    alone = by_id(engine.generate(requests))

    feed = ListFeed([requests[2:4], [GenerationRequest("bad", [], greedy(4))], requests[4:]])
    streamed = list(engine.generate(requests[:2], feed=feed))
    assert sorted(o.request_id for o in streamed) == sorted([*alone, "bad"])
    for out in streamed:
        if out.request_id == "bad":
            assert out.finish_reason == "error" and out.error.param == "prompt"   # validated on arrival
        else:
            assert out.token_ids == alone[out.request_id].token_ids
    assert any(not idle for _, idle in feed.calls)  # parts arrived while others were still running


def test_a_feed_that_ends_at_once_is_no_feed(engine, tokenizer):
    request = GenerationRequest("solo", chat(tokenizer, "Hello"), greedy(3))
    feed = ListFeed([])
    assert [o.request_id for o in engine.generate([request], feed=feed)] == ["solo"]
    assert list(engine.generate([], feed=ListFeed([]))) == []

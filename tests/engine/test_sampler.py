"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""
import math
from types import SimpleNamespace

import torch

from nightshift.engine.sampler import sample
from nightshift.engine.types import SamplingParams

V = 50


def logits_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def test_greedy_is_argmax_per_row():
    logits = logits_rows(4)
    out = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = logits_rows(6)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(6)]
    out = sample(logits, params, [None] * 6)
    for i in range(1, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_top_k_only_picks_among_the_k_best():
    logits = logits_rows(1, seed=3).repeat(300, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 300, [None] * 300)
    assert set(out.token_ids) <= top3
    assert len(set(out.token_ids)) == 3          # high temperature: all three show up


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)) + 1e-9
    logits = probs.log().repeat(400, 1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 400, [None] * 400)
    assert set(out.token_ids) == {0, 1}          # 0.5 < 0.7 <= 0.5 + 0.3
    out = sample(logits[:1], [SamplingParams(temperature=1.0, top_p=0.1)], [None])
    assert out.token_ids == [0]                  # the top token is always kept


def test_top_k_and_top_p_rows_differ_within_one_batch():
    base = logits_rows(1, seed=5)
    logits = base.repeat(2, 1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1.0)]
    for _ in range(20):
        out = sample(logits, params, [None, None])
        assert out.token_ids[0] == int(base.argmax())


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)]).repeat(6000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 6000, [None] * 6000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V)[:3].float() / 6000
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    assert torch.allclose(freq, expected, atol=0.03)


def test_same_seed_same_tokens_whatever_the_batch():
    logits = logits_rows(8, seed=11)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(row, batch_rows, steps=20):
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(steps):
            params = [SamplingParams(temperature=0.8) for _ in batch_rows]
            gens = [None] * len(batch_rows)
            index = batch_rows.index(row)
            params[index], gens[index] = seeded, gen
            tokens.append(sample(logits[batch_rows], params, gens).token_ids[index])
        return tokens

    alone = draws(2, [2])
    assert draws(2, [0, 1, 2, 3, 4]) == alone
    assert draws(2, [7, 2]) == alone
    assert len(set(alone)) > 1                   # it really samples


def test_different_seeds_differ():
    logits = logits_rows(1, seed=2) / 10         # flat distribution
    gen1, gen2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    seq1 = [sample(logits, [SamplingParams(seed=1)], [gen1]).token_ids[0] for _ in range(10)]
    seq2 = [sample(logits, [SamplingParams(seed=2)], [gen2]).token_ids[0] for _ in range(10)]
    assert seq1 != seq2


def test_logprobs_are_raw_log_softmax_of_chosen_tokens():
    logits = logits_rows(3, seed=9)
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0.5, logprobs=True),
              SamplingParams(temperature=0)]
    out = sample(logits, params, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1):
        assert math.isclose(out.logprobs[i], float(ref[i, out.token_ids[i]]), abs_tol=1e-5)
    assert out.logprobs[2] is None


def test_bfloat16_logits_plain_greedy_rows_take_their_argmax():
    """A step of argmaxes only (sampler.plain_greedy) may come as the LM head's bfloat16 logits:
    the tokens are those of the same values as float32, ties to the first index."""
    from nightshift.engine.sampler import plain_greedy
    logits = logits_rows(8, seed=11).bfloat16()
    logits[3, 7] = logits[3, 40] = 99.0                 # a tie
    params = [SamplingParams(temperature=0)] * 8
    assert all(map(plain_greedy, params))
    out = sample(logits, params, [None] * 8)
    assert out.token_ids == logits.float().argmax(-1).tolist() and out.token_ids[3] == 7


def test_bfloat16_logits_of_other_rows_are_taken_as_float32():
    """Rows that are not plain greedy (logprobs, a bias, penalties, temperature) get what the same
    values as float32 give."""
    from nightshift.engine.sampler import plain_greedy
    logits = logits_rows(4, seed=12).bfloat16()
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0, logit_bias={3: 50.0}),
              SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0.7, seed=5)]
    assert not any(map(plain_greedy, params))
    gens = [None, None, None, torch.Generator().manual_seed(5)]
    history = SimpleNamespace(token_ids=[1, 2], num_prompt_tokens=1)
    histories = [history] * 4
    out = sample(logits.clone(), params, gens, histories)
    gens[3] = torch.Generator().manual_seed(5)
    expected = sample(logits.float(), params, gens, histories)
    assert out.token_ids == expected.token_ids and out.token_ids[1] == 3
    assert out.logprobs[0] == expected.logprobs[0]

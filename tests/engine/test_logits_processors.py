"""The batched logits processors against transformers' own processors on the same logits, and
OpenAI's frequency/presence definition; each row of a mixed batch gets only its own treatment."""
import math

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                     RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                     TemperatureLogitsWarper)

from nightshift.engine.grammar import allowed_tokens
from nightshift.engine.logits_processors import (add_logit_bias, apply_grammar_masks, apply_min_p, apply_penalties,
                                                 bar_stop_tokens)
from nightshift.engine.sampler import sample
from nightshift.engine.types import SamplingParams

V = 64


class History:
    def __init__(self, prompt, output):
        self.token_ids = list(prompt) + list(output)
        self.num_prompt_tokens = len(prompt)


def logits_rows(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


HISTORIES = [History([1, 2, 3, 3], [4, 4, 5]), History([7, 8], [8, 9, 9, 9, 1]), History([10], [])]


def test_repetition_penalty_matches_transformers():
    logits = logits_rows(3, seed=1)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
              SamplingParams(repetition_penalty=1.0)]
    ours = logits.clone()
    apply_penalties(ours, params, HISTORIES)
    for i, (p, h) in enumerate(zip(params, HISTORIES)):
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([h.token_ids]), logits[i:i + 1].clone())
        assert torch.allclose(ours[i], ref[0], atol=1e-6), i
    assert torch.equal(ours[2], logits[2])          # 1.0: untouched


def test_frequency_and_presence_follow_openai_definition():
    logits = logits_rows(3, seed=2)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), SamplingParams(frequency_penalty=-1.0),
              SamplingParams(presence_penalty=2.0)]
    ours = logits.clone()
    apply_penalties(ours, params, HISTORIES)
    for i, (p, h) in enumerate(zip(params, HISTORIES)):
        expected = logits[i].clone()
        output = h.token_ids[h.num_prompt_tokens:]
        for token in set(output):   # only generated tokens count, not the prompt's
            count = output.count(token)
            expected[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        assert torch.allclose(ours[i], expected, atol=1e-6), i


def test_min_p_matches_transformers_after_temperature():
    logits = logits_rows(2, seed=3)
    scaled = logits / 0.7
    ours = apply_min_p(scaled.clone(), torch.tensor([0.1, 0.0]))
    ref = MinPLogitsWarper(0.1)(None, TemperatureLogitsWarper(0.7)(None, logits[:1].clone()))
    assert torch.equal(torch.isinf(ours[0]), torch.isinf(ref[0]))
    assert torch.equal(ours[1], scaled[1])


def test_min_tokens_bars_eos_and_stop_ids_like_transformers():
    logits = logits_rows(3, seed=4)
    params = [SamplingParams(min_tokens=5, stop_token_ids=[9]), SamplingParams(min_tokens=5),
              SamplingParams(min_tokens=5, ignore_eos=True)]
    histories = [History([1], [2, 3]), History([1], [2] * 5), History([1], [])]
    ours = logits.clone()
    bar_stop_tokens(ours, params, histories, eos_token_ids=[0])
    ref = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=1, min_new_tokens=5, eos_token_id=[0, 9])(
        torch.tensor([histories[0].token_ids]), logits[:1].clone())
    assert torch.equal(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])                               # reached min_tokens
    assert math.isinf(ours[0, 9]) and not math.isinf(ours[2, 0])          # ignore_eos: EOS is no stop


def test_logit_bias_matches_transformers_sequence_bias():
    logits = logits_rows(2, seed=5)
    params = [SamplingParams(logit_bias={3: 5.0, 10: -100.0}), SamplingParams()]
    ours = logits.clone()
    add_logit_bias(ours, params)
    ref = SequenceBiasLogitsProcessor({(3,): 5.0, (10,): -100.0})(torch.tensor([[1]]), logits[:1].clone())
    assert torch.allclose(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])


def test_grammar_masks_keep_only_allowed_tokens_and_report_dead_ends():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)      # tokens 3 and 31 (bit 31 is the int32 sign bit)
    bitmask[0, 1] = 1 << 1                    # token 33
    allowed = allowed_tokens(bitmask, V)
    assert allowed[0].nonzero().flatten().tolist() == [3, 31, 33]
    logits = logits_rows(3, seed=6)
    out = logits.clone()
    dead = apply_grammar_masks(out, [0, 2], bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 31, 33]
    assert torch.equal(out[1], logits[1])     # unconstrained row untouched
    assert dead == [2]                        # its bitmask row allows nothing


def test_sample_applies_bias_and_penalties_to_greedy_rows_and_keeps_raw_logprobs():
    logits = logits_rows(2, seed=7)
    worst = int(logits[0].argmin())
    params = [SamplingParams(temperature=0, logit_bias={worst: 100.0}, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)]
    best = int(logits[1].argmax())
    histories = [History([1], []), History([1], [best] * 20)]
    out = sample(logits.clone(), params, [None, None], histories)
    assert out.token_ids[0] == worst
    assert out.token_ids[1] != best           # penalised out of first place
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprobs[0], float(raw[worst]), abs_tol=1e-5)
    top = raw.topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.top_logprobs[1] is None


def test_grammar_mask_applies_to_sampled_rows_too():
    logits = logits_rows(1, seed=8).repeat(200, 1)
    bitmask = torch.zeros(200, 2, dtype=torch.int32)
    bitmask[:, 0] = (1 << 5) | (1 << 6)
    out = sample(logits, [SamplingParams(temperature=2.0)] * 200, [None] * 200, masks=(list(range(200)), bitmask))
    assert set(out.token_ids) == {5, 6}


def test_torch_mask_path_equals_the_cpu_kernel(monkeypatch):
    """Where the C kernel cannot run (CUDA logits, no compiler) the torch path gives the same."""
    from nightshift.engine.kernels import cpu_token_bitmask
    g = torch.Generator().manual_seed(9)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32, generator=g)
    bitmask[1] = 0
    logits = logits_rows(4, seed=10)
    kernel = logits.clone()
    dead_kernel = apply_grammar_masks(kernel, [0, 1, 3], bitmask)
    monkeypatch.setattr(cpu_token_bitmask, "supports", lambda _: False)
    plain = logits.clone()
    dead_plain = apply_grammar_masks(plain, [0, 1, 3], bitmask)
    assert torch.equal(kernel, plain) and dead_kernel == dead_plain == [1]

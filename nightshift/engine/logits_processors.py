"""What a step's logits go through before a token is chosen, each for a whole batch at once on the
logits' device, touching only the rows that ask for it (a batch of defaults costs nothing here).

In the sampler's order (vLLM's): logit_bias, min_tokens (EOS and stop tokens barred), the grammar
mask, then the penalties (repetition, then frequency and presence), all before temperature; min_p
after temperature. Definitions:
- frequency / presence (OpenAI): ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``
  over the tokens generated so far;
- repetition (transformers' RepetitionPenaltyLogitsProcessor, vLLM's): every token of the prompt
  or the output so far has its logit divided by the penalty where positive, multiplied where negative;
- min_p (transformers' MinPLogitsWarper, vLLM's): tokens whose probability is below
  ``min_p * max probability`` are dropped.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence as Seq

import torch

from nightshift.engine.grammar import allowed_tokens
from nightshift.engine.kernels import cpu_token_bitmask
from nightshift.engine.types import SamplingParams


class TokenHistory(Protocol):
    """A row's tokens so far: the prompt, then what it generated (engine.sequence.Sequence is one)."""
    token_ids: list[int]
    num_prompt_tokens: int


def _rows(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def add_logit_bias(logits: torch.Tensor, params: Seq[SamplingParams]) -> None:
    rows, tokens, values = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias.items():
            rows.append(i)
            tokens.append(int(token))
            values.append(float(value))
    if rows:
        device = logits.device
        logits.index_put_((_rows(rows, device), _rows(tokens, device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def bar_stop_tokens(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[TokenHistory],
                    eos_token_ids: Seq[int]) -> None:
    """min_tokens: before a row has generated that many tokens, its stop tokens cannot be sampled."""
    rows, tokens = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(histories[i].token_ids) - histories[i].num_prompt_tokens < p.min_tokens:
            barred = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows.extend([i] * len(barred))
            tokens.extend(barred)
    if rows:
        logits[_rows(rows, logits.device), _rows(tokens, logits.device)] = float("-inf")


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> list[int]:
    """Keep only the tokens each constrained row's grammar allows; returns the rows whose grammar
    allows no token at all (a dead end: the caller ends those requests)."""
    if cpu_token_bitmask.supports(logits):
        allowed_any = cpu_token_bitmask.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long), bitmask)
    else:
        index = _rows(rows, logits.device)
        allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
        allowed_any = allowed.any(dim=1).cpu()
    return [rows[j] for j in (~allowed_any).nonzero().flatten().tolist()]


def _token_rows(lists: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of ragged per-row token tensors, flattened."""
    lengths = torch.tensor([len(t) for t in lists], device=device)
    row_of = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)
    return row_of, torch.cat(lists).to(device)


def _ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def apply_penalties(logits: torch.Tensor, params: Seq[SamplingParams], histories: Seq[TokenHistory]) -> None:
    device, vocab = logits.device, logits.shape[1]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        index = _rows(rep, device)
        row_of, token = _token_rows([_ids(histories[i].token_ids) for i in rep], device)
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
        seen[row_of, token] = True
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=logits.dtype,
                               device=device).unsqueeze(1)
        sub = logits[index]
        logits[index] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    freq = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if freq:
        index = _rows(freq, device)
        row_of, token = _token_rows([_ids(histories[i].token_ids[histories[i].num_prompt_tokens:])
                                     for i in freq], device)
        counts = torch.zeros(len(freq), vocab, dtype=logits.dtype, device=device)
        counts.index_put_((row_of, token), torch.ones_like(token, dtype=logits.dtype), accumulate=True)
        frequency = torch.tensor([params[i].frequency_penalty for i in freq], dtype=logits.dtype, device=device)
        presence = torch.tensor([params[i].presence_penalty for i in freq], dtype=logits.dtype, device=device)
        logits[index] -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_p(scaled: torch.Tensor, min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """scaled: temperature-scaled logits of sampled rows; min_p: per row (0 off), or None."""
    if min_p is None:
        return scaled
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return scaled.masked_fill(probs < threshold, float("-inf"))

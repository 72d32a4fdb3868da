"""Token sampling for a whole step at once.

Greedy rows take the argmax. Other rows: logits / temperature, then top-k and top-p
masks (one sort for the whole batch), then the exponential race
`argmax(probs / Exp(1))`, which draws exactly from `probs`. Unseeded rows share one
batch-wide noise draw; a seeded request draws its own row of noise from its own
torch.Generator, one row per generated token, so the same seed gives the same tokens
whatever else is in the batch. Logprobs are those of the model's raw distribution
(before temperature, top-k, top-p), as OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from nightshift.engine.types import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are treated as greedy


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Optional[float]]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask everything outside each row's top-k / nucleus with -inf. k == vocab or p == 1: off."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, params: Seq[SamplingParams],
           generators: Seq[Optional[torch.Generator]]) -> SampleResult:
    """logits: float32 [batch, vocab], one row per entry of params/generators."""
    batch, vocab = logits.shape
    temps = [p.temperature for p in params]
    greedy = [t < GREEDY_TEMPERATURE for t in temps]

    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(batch, dtype=torch.long)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if greedy_rows:
            idx = torch.tensor(greedy_rows)
            tokens[idx] = logits[idx].argmax(dim=-1)
        idx = torch.tensor(random_rows)
        scaled = logits[idx] / torch.tensor([temps[i] for i in random_rows]).unsqueeze(1)
        ks = [params[i].top_k for i in random_rows]
        ps = [params[i].top_p for i in random_rows]
        top_k = None
        if any(0 < k < vocab for k in ks):
            top_k = torch.tensor([k if 0 < k < vocab else vocab for k in ks])
        top_p = torch.tensor(ps, dtype=scaled.dtype) if any(p < 1.0 for p in ps) else None
        if top_k is not None or top_p is not None:
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [(j, generators[i]) for j, i in enumerate(random_rows) if generators[i] is not None]
        if len(seeded) < len(random_rows):
            noise.exponential_()
        for j, gen in seeded:
            noise[j].exponential_(generator=gen)
        tokens[idx] = probs.div_(noise).argmax(dim=-1)

    logprobs: list[Optional[float]] = [None] * batch
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        idx = torch.tensor(want)
        rows = logits[idx]
        chosen = rows.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)
        values = (chosen - rows.logsumexp(dim=-1)).tolist()
        for i, v in zip(want, values):
            logprobs[i] = v
    return SampleResult(tokens.tolist(), logprobs)

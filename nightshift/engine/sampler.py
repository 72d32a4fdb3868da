"""Token sampling for a whole step at once.

First the logits processors (engine/logits_processors.py: logit_bias, min_tokens, grammar masks,
penalties), only for the rows that ask for them. Greedy rows then take the argmax (on the CPU a
C kernel of torch's answer, engine/kernels/cpu_argmax.py). Other rows:
logits / temperature, then min_p, then top-k and top-p masks (one sort for the whole batch),
then the exponential race `argmax(probs / Exp(1))`, which draws exactly from `probs`. Unseeded
rows share one batch-wide noise draw; a seeded request draws its own row of noise from its own
torch.Generator, one row per generated token, so the same seed gives the same tokens whatever
else is in the batch. Logprobs (and the top_logprobs alternatives) are those of the model's raw
distribution (before bias, masks, penalties, temperature, top-k, top-p), as OpenAI reports them.

Grammar masks come two ways (engine/grammar.py). `masks`: applied to the logits first, for
constrained rows with top-k, top-p or min_p (those depend on which tokens the mask leaves).
`late`: the other constrained rows (greedy, or plain temperature) are sampled unmasked, and only
a row whose token its grammar refuses is masked and picks again from the same scores (its
logits, or its race's probs / noise): masking only removes candidates, so an accepted winner is
the masked winner too, and a re-pick is the token masking first would have given.

A step whose every row is `plain_greedy` needs only each row's argmax: the engine asks the model
for the logits as its LM head computes them (bfloat16 on the CPU's bf16 math, each value exactly
what float32 holds of it), and the argmax kernel reads those. Any other step's logits are float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence as Seq

import torch

from nightshift.engine.kernels.cpu_argmax import row_argmax
from nightshift.engine.logits_processors import (TokenHistory, add_logit_bias, apply_grammar_masks, apply_min_p,
                                                 apply_penalties, bar_stop_tokens)
from nightshift.engine.types import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are treated as greedy


def plain_greedy(params: SamplingParams) -> bool:
    """A row whose token is the argmax of its raw logits: greedy, no logprobs, nothing that changes
    the logits (logit_bias, min_tokens, penalties); a grammar is the caller's to rule out."""
    return (params.temperature < GREEDY_TEMPERATURE and not params.logprobs and not params.logit_bias
            and not _history(params))


def _history(params: SamplingParams) -> bool:
    """Whether the row's logits depend on its tokens so far (min_tokens, penalties)."""
    return bool(params.min_tokens or params.repetition_penalty != 1.0 or params.frequency_penalty
                or params.presence_penalty)


class LateMasks(Protocol):
    """Constrained rows sampled without a mask (engine/grammar.py's LateGrammarCheck)."""
    rows: list[int]

    def refused(self, tokens: list[int]) -> Optional[tuple[list[int], torch.Tensor]]:
        """Given the tokens chosen for `rows` (in that order): the rows whose grammar refuses its
        token, with their int32 bitmasks; None when every token is accepted."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Optional[float]]
    # per row that asked for alternatives: (token id, logprob) of the most likely tokens, best first
    top_logprobs: list[Optional[list[tuple[int, float]]]] = field(default_factory=list)
    dead_ends: list[int] = field(default_factory=list)   # rows whose grammar allowed no token


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


@torch.inference_mode()
def sample(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[Optional[torch.Generator]],
           histories: Optional[Seq[TokenHistory]] = None, eos_token_ids: Seq[int] = (),
           masks: Optional[tuple[list[int], torch.Tensor]] = None,
           late: Optional[LateMasks] = None) -> SampleResult:
    """logits: float32 [batch, vocab] (or bfloat16 where every row is `plain_greedy` and nothing is
    masked: taken as float32 otherwise), one row per entry of params/generators (and histories: each
    row's tokens so far, needed by penalties and min_tokens). masks: (rows, int32 bitmask) of the
    constrained rows masked first; late: those checked after sampling (module docstring). The
    logits may be changed in place."""
    batch, vocab = logits.shape
    if logits.dtype != torch.float32 and not (all(map(plain_greedy, params)) and not masks
                                              and (late is None or not late.rows)):
        logits = logits.float()
    want = [i for i, p in enumerate(params) if p.logprobs]
    processed, dead_ends = _processed(logits, params, histories, eos_token_ids, masks, keep_raw=bool(want))
    tokens, scores = _choose(processed, params, generators)
    if late is not None and late.rows:
        chosen = tokens.tolist()
        refused = late.refused([chosen[r] for r in late.rows])
        if refused is not None:
            rows, bitmask = refused
            again = scores.of(rows)
            dead = set(apply_grammar_masks(again, list(range(len(rows))), bitmask))
            for j, (row, token) in enumerate(zip(rows, row_argmax(again).tolist())):
                chosen[row] = token
                if j in dead:
                    dead_ends.append(row)
            tokens = torch.tensor(chosen, device=logits.device)

    logprobs: list[Optional[float]] = [None] * batch
    top: list[Optional[list[tuple[int, float]]]] = [None] * batch
    if want:
        idx = torch.tensor(want, device=logits.device)
        rows = logits[idx]
        lse = rows.logsumexp(dim=-1, keepdim=True)
        chosen = rows.gather(1, tokens[idx].unsqueeze(1))
        for i, v in zip(want, (chosen - lse).squeeze(1).tolist()):
            logprobs[i] = v
        k = max(params[i].top_logprobs for i in want)
        if k > 0:
            values, ids = (rows - lse).topk(min(k, vocab), dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for j, i in enumerate(want):
                count = params[i].top_logprobs
                if count:
                    top[i] = list(zip(ids[j][:count], values[j][:count]))
    return SampleResult(tokens.tolist(), logprobs, top, dead_ends)


def _processed(logits: torch.Tensor, params: Seq[SamplingParams], histories: Optional[Seq[TokenHistory]],
               eos_token_ids: Seq[int], masks: Optional[tuple[list[int], torch.Tensor]],
               keep_raw: bool) -> tuple[torch.Tensor, list[int]]:
    """The logits after bias, min_tokens, grammar masks and penalties (a copy when the raw ones
    are still needed for logprobs); the rows whose grammar allows nothing."""
    bias = any(p.logit_bias for p in params)
    history = any(map(_history, params))
    if not (bias or history or masks):
        return logits, []
    if history and histories is None:
        raise ValueError("penalties and min_tokens need each row's token history")
    out = logits.clone() if keep_raw else logits
    dead: list[int] = []
    if bias:
        add_logit_bias(out, params)
    if history:
        bar_stop_tokens(out, params, histories, eos_token_ids)
    if masks:
        dead = apply_grammar_masks(out, *masks)
    if history:
        apply_penalties(out, params, histories)
    return out, dead


@dataclass
class _Scores:
    """What each row's token is the argmax of: its processed logits (greedy rows) or its race's
    probs / noise (other rows, `race[race_row[row]]`)."""
    logits: torch.Tensor
    race: Optional[torch.Tensor] = None
    race_row: dict[int, int] = field(default_factory=dict)

    def of(self, rows: list[int]) -> torch.Tensor:
        """A copy of these rows' scores, [len(rows), vocab]."""
        return torch.stack([self.race[self.race_row[r]] if r in self.race_row else self.logits[r] for r in rows])


def late_maskable(params: SamplingParams) -> bool:
    """Whether a constrained row may be sampled unmasked and checked after (module docstring):
    greedy, or temperature without top-k, top-p or min_p."""
    return params.temperature < GREEDY_TEMPERATURE or (params.top_k in (0, -1) and params.top_p >= 1.0
                                                       and params.min_p == 0)


def _choose(logits: torch.Tensor, params: Seq[SamplingParams],
            generators: Seq[Optional[torch.Generator]]) -> tuple[torch.Tensor, _Scores]:
    batch, vocab = logits.shape
    temps = [p.temperature for p in params]
    greedy = [t < GREEDY_TEMPERATURE for t in temps]
    if all(greedy):
        return row_argmax(logits), _Scores(logits)
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, g in enumerate(greedy) if g]
    random_rows = [i for i, g in enumerate(greedy) if not g]
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=logits.device)
        tokens[idx] = row_argmax(logits[idx])
    idx = torch.tensor(random_rows, device=logits.device)
    scaled = logits[idx] / torch.tensor([temps[i] for i in random_rows], device=logits.device).unsqueeze(1)
    min_ps = [params[i].min_p for i in random_rows]
    if any(min_ps):
        scaled = apply_min_p(scaled, torch.tensor(min_ps, dtype=scaled.dtype, device=logits.device))
    ks = [params[i].top_k for i in random_rows]
    ps = [params[i].top_p for i in random_rows]
    top_k = None
    if any(0 < k < vocab for k in ks):
        top_k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=logits.device)
    top_p = torch.tensor(ps, dtype=scaled.dtype, device=logits.device) if any(p < 1.0 for p in ps) else None
    if top_k is not None or top_p is not None:
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    seeded = [(j, generators[i]) for j, i in enumerate(random_rows) if generators[i] is not None]
    if len(seeded) < len(random_rows):
        noise.exponential_()
    for j, gen in seeded:
        noise[j].exponential_(generator=gen)
    race = probs.div_(noise)
    tokens[idx] = row_argmax(race)
    return tokens, _Scores(logits, race, {row: j for j, row in enumerate(random_rows)})

"""Which inputs run together: sorted by length, cut into steps under a token budget.

Sorting makes each step's sequences nearly equal in length, so attention runs over a few runs of
equal length (varlen.py), and the linear layers see no padding at all. Longest first: the
biggest steps run while memory is freshest, and a long tail of short inputs finishes fast.
"""
from __future__ import annotations


def plan_steps(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices into `lengths`, grouped into steps: longest first, each step at most `max_seqs`
    sequences whose count x longest stays within `max_tokens` (a bound on the step's tokens and
    its attention work); a single sequence longer than the budget gets a step of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    steps: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) >= max_seqs or (len(current) + 1) * longest > max_tokens):
            steps.append(current)
            current = []
        current.append(index)
    if current:
        steps.append(current)
    return steps

"""Prefix-grouped shard planning.

Requests are sorted by their prompt token ids, so prompts that share a prefix (a system
prompt, a few-shot header) sit next to each other, then cut greedily into shards of at most
``max_requests`` requests whose planned tokens (prompt + max_tokens) stay within a budget.
Shards are the unit several engine workers share a batch by; a worker streams one shard after
another through its engine, so neighbouring shards still meet in its prefix cache. A cut
prefers a point where the shared prefix with the next request is short, so a group is not
split when a nearby boundary keeps it whole; a cut never moves back so far that a shard of at
least ``min_requests`` requests ends up with fewer.

So that N engine workers share even a mid-sized batch, a batch is planned into at least
``min_shards`` shards as long as each then holds at least ``min_requests`` requests: until that many are planned, each
shard is cut at about an even share of the requests still to plan (``remaining / shards
left``), so the cuts that move back to a group boundary are made up by the shards after them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class PlannedShard:
    seq: int
    members: list[int]          # indexes into the planned items, in run order
    planned_tokens: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _wanted_shards(n: int, min_shards: int, min_requests: int) -> int:
    """How many shards the request count alone asks for: ``min_shards``, fewer when that would
    leave shards under ``min_requests`` (at least one)."""
    return max(1, min(min_shards, n // max(1, min_requests)))


def plan_shards(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], token_budget: int,
                max_requests: int, lookback: int = 32, *, min_shards: int = 1,
                min_requests: int = 1) -> list[PlannedShard]:
    """Group item indexes into shards of at most ``max_requests`` items and ``token_budget``
    planned tokens (an item bigger than the budget gets a shard of its own), and into at least
    ``min_shards`` shards where each keeps ``min_requests`` or more. ``lookback`` bounds how far
    back a cut may move to land between two requests that share less prefix."""
    if token_budget < 1 or max_requests < 1 or min_shards < 1 or min_requests < 1:
        raise ValueError("token_budget, max_requests, min_shards and min_requests must be positive")
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    costs = [len(prompts[i]) + max(0, max_tokens[i]) for i in order]
    wanted = _wanted_shards(len(order), min_shards, min_requests)
    shards: list[PlannedShard] = []
    start = 0
    while start < len(order):
        remaining = len(order) - start
        shards_left = max(wanted - len(shards), 1)
        cap = min(max_requests, -(-remaining // shards_left))   # an even share of what is left
        end, total = start, 0
        while end < len(order) and (end == start or (total + costs[end] <= token_budget and end - start < cap)):
            total += costs[end]
            end += 1
        if end < len(order) and end - start > 1:
            # Move the cut back (within lookback, keeping min_requests in a shard that had them)
            # to the boundary with the least shared prefix.
            floor = start + (min_requests if end - start > min_requests else 1)
            best, best_shared = end, _common_prefix(prompts[order[end - 1]], prompts[order[end]])
            for cut in range(end - 1, max(floor, end - lookback) - 1, -1):
                shared = _common_prefix(prompts[order[cut - 1]], prompts[order[cut]])
                if shared < best_shared:
                    best, best_shared = cut, shared
                    if shared == 0:
                        break
            end = best
            total = sum(costs[start:end])
        shards.append(PlannedShard(len(shards), order[start:end], total))
        start = end
    return shards

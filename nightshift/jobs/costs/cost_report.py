"""The cost report of one batch as documents: cost.json (totals, per device, savings,
timeline) and cost.csv (one row per request). Pure: ``batch_costs`` feeds it the rows.

Every figure is a sum over per-request records (each written exactly once by the shard
attempt that answered the request), so a re-run shard cannot count twice and the totals
always equal the sum of the CSV rows. Dollar sums use `math.fsum` (correctly rounded), so a
test can recompute them exactly from the rows.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from nightshift.jobs.costs.accounting import PER_MILLION, Prices, RequestUsage, online_cost_usd, request_cost_usd

TIMELINE_BUCKETS = 48


def _per_million(usd: float, tokens: int) -> Optional[float]:
    return usd / tokens * PER_MILLION if tokens else None


@dataclass
class _Totals:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_seconds: list[float] = field(default_factory=list)
    usd: list[float] = field(default_factory=list)

    def add(self, usage: RequestUsage, usd: float) -> None:
        self.requests += 1
        self.completed += usage.status == "completed"
        self.failed += usage.status == "failed"
        self.prompt_tokens += usage.prompt_tokens
        self.cached_prompt_tokens += usage.cached_prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.engine_seconds.append(usage.engine_seconds)
        self.usd.append(usd)


def build_cost_report(usages: Sequence[RequestUsage], prices: Prices, *,
                      batch_id: str, model: Optional[str] = None,
                      status: Optional[str] = None,
                      generated_at: Optional[float] = None) -> dict:
    """The cost.json document of one batch (totals, per device, savings, timeline)."""
    totals = _Totals()
    per_device: dict[str, _Totals] = {}
    queue_waits: list[float] = []
    for usage in usages:
        usd = request_cost_usd(usage, prices)
        totals.add(usage, usd)
        if usage.engine_seconds > 0 or usage.device:
            device = usage.device or "unknown"
            per_device.setdefault(device, _Totals()).add(usage, usd)
        if usage.queue_seconds is not None:
            queue_waits.append(usage.queue_seconds)

    cost_usd = math.fsum(totals.usd)
    online_usd = online_cost_usd(totals.prompt_tokens, totals.cached_prompt_tokens,
                                 totals.completion_tokens, prices)
    cache_savings = totals.cached_prompt_tokens * prices.online_input_usd_per_1m / PER_MILLION
    started = [u.started_at for u in usages if u.started_at is not None]
    finished = [u.finished_at for u in usages if u.finished_at is not None]
    total_tokens = totals.prompt_tokens + totals.completion_tokens
    return {
        "object": "batch.cost",
        "batch_id": batch_id,
        "model": model,
        "status": status,
        "generated_at": int(generated_at) if generated_at is not None else None,
        "currency": "USD",
        "requests": {"total": totals.requests, "completed": totals.completed,
                     "failed": totals.failed},
        "tokens": {
            "prompt_tokens": totals.prompt_tokens,
            "cached_prompt_tokens": totals.cached_prompt_tokens,
            "uncached_prompt_tokens": totals.prompt_tokens - totals.cached_prompt_tokens,
            "completion_tokens": totals.completion_tokens,
            "total_tokens": total_tokens,
            "prefix_cache_hit_rate": (totals.cached_prompt_tokens / totals.prompt_tokens
                                      if totals.prompt_tokens else None),
        },
        "engine_seconds": math.fsum(totals.engine_seconds),
        "queue_seconds": {
            "mean": math.fsum(queue_waits) / len(queue_waits) if queue_waits else None,
            "max": max(queue_waits) if queue_waits else None,
        },
        "wall_seconds": max(finished) - min(started) if started and finished else None,
        "cost": {
            "usd": cost_usd,
            # The whole job's cost per million tokens of each kind (what a million input,
            # output, or any tokens cost at this job's mix), not a split of the cost.
            "usd_per_1m_input_tokens": _per_million(cost_usd, totals.prompt_tokens),
            "usd_per_1m_output_tokens": _per_million(cost_usd, totals.completion_tokens),
            "usd_per_1m_total_tokens": _per_million(cost_usd, total_tokens),
        },
        "by_device": [
            {"device": device,
             "usd_per_hour": prices.hourly_price(None if device == "unknown" else device),
             "requests": t.requests,
             "engine_seconds": math.fsum(t.engine_seconds),
             "usd": math.fsum(t.usd)}
            for device, t in sorted(per_device.items())
        ],
        "savings": {
            # What the cached prompt tokens would have cost at the online input list price.
            "cache_usd": cache_savings,
            "online_list_usd": online_usd,
            "vs_online_list_usd": online_usd - cost_usd,
            "vs_online_list_pct": ((online_usd - cost_usd) / online_usd * 100.0
                                   if online_usd else None),
        },
        "prices": prices.as_dict(),
        # devices with engine time but no configured price: their time is not in cost.usd
        "unpriced_devices": sorted(d for d, t in per_device.items()
                                   if prices.hourly_price(None if d == "unknown" else d) is None),
        "timeline": build_timeline(usages, prices),
    }


def build_timeline(usages: Iterable[RequestUsage], prices: Prices,
                   buckets: int = TIMELINE_BUCKETS) -> list[dict]:
    """Tokens and dollars of finished requests over the job's time, in equal buckets
    (the data behind the cost page's chart). Bucket `t` is its start, in Unix seconds."""
    done = [u for u in usages if u.finished_at is not None]
    if not done:
        return []
    start = min((u.started_at or u.finished_at) for u in done)
    end = max(u.finished_at for u in done)
    width = max((end - start) / buckets, 1.0)
    count = min(buckets, int((end - start) // width) + 1)
    rows = [{"t": start + i * width, "requests": 0, "prompt_tokens": 0,
             "completion_tokens": 0, "usd": []} for i in range(count)]
    for usage in done:
        index = min(count - 1, int((usage.finished_at - start) // width))
        row = rows[index]
        row["requests"] += 1
        row["prompt_tokens"] += usage.prompt_tokens
        row["completion_tokens"] += usage.completion_tokens
        row["usd"].append(request_cost_usd(usage, prices))
    for row in rows:
        row["usd"] = math.fsum(row["usd"])
    return rows


CSV_COLUMNS = ("line", "custom_id", "status", "prompt_tokens", "cached_prompt_tokens",
               "completion_tokens", "engine_seconds", "queue_seconds", "worker", "device",
               "usd_per_hour", "cost_usd", "online_list_usd", "started_at", "finished_at")


def _seconds(value: Optional[float]) -> str:
    return "" if value is None else repr(value)


def cost_csv(usages: Iterable[RequestUsage], prices: Prices) -> bytes:
    """cost.csv: one row per request, in input order; times in Unix seconds. Floats are
    written with repr() so the rows sum back exactly to the totals of cost.json."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for u in sorted(usages, key=lambda u: u.line):
        queue = u.queue_seconds
        price = prices.hourly_price(u.device) if (u.device or u.engine_seconds > 0) else None
        writer.writerow([
            u.line, u.custom_id, u.status, u.prompt_tokens, u.cached_prompt_tokens,
            u.completion_tokens, repr(float(u.engine_seconds)),
            "" if queue is None else repr(queue), u.worker or "", u.device or "",
            "" if price is None else repr(price), repr(request_cost_usd(u, prices)),
            repr(online_cost_usd(u.prompt_tokens, u.cached_prompt_tokens,
                                 u.completion_tokens, prices)),
            _seconds(u.started_at), _seconds(u.finished_at),
        ])
    return out.getvalue().encode()

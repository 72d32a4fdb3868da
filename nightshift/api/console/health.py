"""The health page's live figures: the engine's throughput, read from the counters /metrics
serves (api/metrics.engine_totals: every process's samples where PROMETHEUS_MULTIPROC_DIR is
shared, as under `nightshift serve`), and the broker's queue depths.

A rate needs two readings: each process keeps its recent readings (one per health request, at
most every ``MIN_GAP_SECONDS``) and answers the rate over the last ``WINDOW_SECONDS`` it has seen;
the first reading of a process has no rate yet (the page's next poll brings one).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from nightshift.api.metrics import QUEUES, engine_totals

WINDOW_SECONDS = 60.0
MIN_GAP_SECONDS = 1.0


class ThroughputMeter:
    def __init__(self, read: Callable[[], dict[str, float]] = engine_totals,
                 clock: Callable[[], float] = time.monotonic):
        self.read, self.clock = read, clock
        self.readings: deque[tuple[float, dict[str, float]]] = deque()
        self.lock = threading.Lock()

    def rates(self) -> dict[str, Optional[float]]:
        """Per second over the window: completion and prompt tokens, requests (None until two
        readings are ``MIN_GAP_SECONDS`` apart), the totals so far and the window's length."""
        now = self.clock()
        with self.lock:
            if not self.readings or now - self.readings[-1][0] >= MIN_GAP_SECONDS:
                self.readings.append((now, self.read()))
            while len(self.readings) > 2 and now - self.readings[1][0] >= WINDOW_SECONDS:
                self.readings.popleft()
            (first_at, first), (last_at, last) = self.readings[0], self.readings[-1]
        span = last_at - first_at
        # a counter that went down was reset (its processes' files removed): no rate across that
        out: dict[str, Optional[float]] = {f"{name}_per_second": ((last[name] - first[name]) / span
                                                                  if span and last[name] >= first[name] else None)
                                           for name in last}
        out.update({f"{name}_total": value for name, value in last.items()})
        out["window_seconds"] = span or None
        return out


METER = ThroughputMeter()


def _per_second(value: Optional[float], unit: str) -> str:
    return "measuring…" if value is None else f"{value:,.1f} {unit}/s"


def health_view(rates: dict[str, Optional[float]], depths: dict[str, int]) -> dict:
    """The health figures as the page shows them (the page and its poll)."""
    window = rates["window_seconds"]
    return {"throughput": {
                "completion": _per_second(rates["completion_tokens_per_second"], "output tokens"),
                "prompt": _per_second(rates["prompt_tokens_per_second"], "tokens"),
                "requests": _per_second(rates["requests_per_second"], "requests"),
                "window": f"over the last {window:.0f} s" if window else "a second reading is needed",
                "totals": f"{rates['completion_tokens_total']:,.0f} output tokens, "
                          f"{rates['requests_total']:,.0f} requests so far"},
            "queues": {queue: str(depths[queue]) if queue in depths else "unknown" for queue in QUEUES}}

"""Cost accounting: what one request consumed and what it costs (pure, no database).

Pricing model: the engine reports, per request, its fair share of the engine time of every
step it was in (`engine_seconds`). A request costs `engine_seconds * price_per_hour / 3600`
of the device kind it ran on. The online list prices are only a yardstick: what the same
tokens would have cost on a hosted API.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from nightshift.jobs.batches.openai_mapping import EMBEDDINGS
from nightshift.settings import Settings

PER_MILLION = 1_000_000.0


@dataclass(frozen=True)
class Prices:
    """Instance prices per device kind and the online list prices to compare against."""

    instance_usd_per_hour: Mapping[str, float]
    online_input_usd_per_1m: float
    online_cached_input_usd_per_1m: float
    online_output_usd_per_1m: float

    def hourly_price(self, device: Optional[str]) -> Optional[float]:
        """Price of the device a request ran on: exact name, then its kind before ':'
        ("cuda:0" -> "cuda"), then the "default" entry; None when none is configured (the
        report then lists the device under `unpriced_devices` instead of failing finalize)."""
        table = self.instance_usd_per_hour
        if device:
            if device in table:
                return float(table[device])
            kind = device.split(":", 1)[0]
            if kind in table:
                return float(table[kind])
        if "default" in table:
            return float(table["default"])
        return None

    def as_dict(self) -> dict:
        return {
            "instance_usd_per_hour": dict(self.instance_usd_per_hour),
            "online_input_usd_per_1m": self.online_input_usd_per_1m,
            "online_cached_input_usd_per_1m": self.online_cached_input_usd_per_1m,
            "online_output_usd_per_1m": self.online_output_usd_per_1m,
        }


@dataclass(frozen=True)
class RequestUsage:
    """What one request consumed. Times are Unix seconds, as stored (None if unrun)."""

    custom_id: str
    line: int
    status: str
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_seconds: float = 0.0
    queued_at: Optional[float] = None
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    worker: Optional[str] = None
    device: Optional[str] = None

    @property
    def queue_seconds(self) -> Optional[float]:
        if self.queued_at is None or self.started_at is None:
            return None
        return max(0.0, self.started_at - self.queued_at)


def request_cost_usd(usage: RequestUsage, prices: Prices) -> float:
    price = prices.hourly_price(usage.device)
    if usage.engine_seconds <= 0 or price is None:
        return 0.0
    return usage.engine_seconds * price / 3600.0


def online_cost_usd(prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
                    prices: Prices) -> float:
    """What a hosted API charging the configured list prices would bill for these tokens."""
    uncached = prompt_tokens - cached_prompt_tokens
    return (uncached * prices.online_input_usd_per_1m
            + cached_prompt_tokens * prices.online_cached_input_usd_per_1m
            + completion_tokens * prices.online_output_usd_per_1m) / PER_MILLION


def prices_from_settings(settings: Settings, endpoint: Optional[str] = None) -> Prices:
    """The prices of a batch's endpoint: embeddings are compared with the online embedding price
    (input tokens only), the other endpoints with the chat list prices."""
    if endpoint == EMBEDDINGS:
        return Prices(instance_usd_per_hour=dict(settings.instance_usd_per_hour),
                      online_input_usd_per_1m=settings.online_embedding_usd_per_1m,
                      online_cached_input_usd_per_1m=settings.online_embedding_usd_per_1m,
                      online_output_usd_per_1m=0.0)
    return Prices(instance_usd_per_hour=dict(settings.instance_usd_per_hour),
                  online_input_usd_per_1m=settings.online_input_usd_per_1m,
                  online_cached_input_usd_per_1m=settings.online_cached_input_usd_per_1m,
                  online_output_usd_per_1m=settings.online_output_usd_per_1m)

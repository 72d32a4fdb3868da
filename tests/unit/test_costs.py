"""Cost report arithmetic: totals are exact sums of the per-request rows."""
import csv
import io
import math
from datetime import datetime, timezone

import pytest

from nightshift.jobs.costs.accounting import Prices, RequestUsage, request_cost_usd
from nightshift.jobs.costs.cost_report import build_cost_report, cost_csv

T0 = datetime(2026, 11, 22, 2, 0, tzinfo=timezone.utc).timestamp()
PRICES = Prices(instance_usd_per_hour={"cpu": 0.12, "cuda": 2.5},
                online_input_usd_per_1m=0.15, online_cached_input_usd_per_1m=0.075,
                online_output_usd_per_1m=0.60)


def usage(i, *, prompt=100, cached=0, completion=20, secs=0.5, device="cpu", status="completed"):
    return RequestUsage(custom_id=f"r{i}", line=i, status=status, prompt_tokens=prompt,
                        cached_prompt_tokens=cached, completion_tokens=completion,
                        engine_seconds=secs, queued_at=T0,
                        started_at=T0 + i,
                        finished_at=T0 + i + 2,
                        worker="w1", device=device)


def test_totals_are_exact_sums_of_rows():
    rows = [usage(i, prompt=100 + i, cached=16 * (i % 3), completion=7 * i,
                  secs=0.1 * i + 0.013, device="cuda:0" if i % 2 else "cpu") for i in range(1, 40)]
    rows.append(usage(40, prompt=0, completion=0, secs=0.0, device=None, status="failed"))
    report = build_cost_report(rows, PRICES, batch_id="batch_x")
    assert report["requests"] == {"total": 40, "completed": 39, "failed": 1}
    assert report["tokens"]["prompt_tokens"] == sum(r.prompt_tokens for r in rows)
    assert report["tokens"]["cached_prompt_tokens"] == sum(r.cached_prompt_tokens for r in rows)
    assert report["tokens"]["completion_tokens"] == sum(r.completion_tokens for r in rows)
    assert report["engine_seconds"] == math.fsum(r.engine_seconds for r in rows)
    per_request = [r.engine_seconds * (2.5 if r.device == "cuda:0" else 0.12) / 3600 for r in rows]
    assert report["cost"]["usd"] == math.fsum(per_request)
    assert report["cost"]["usd"] == math.fsum(d["usd"] for d in report["by_device"])
    devices = {d["device"]: d for d in report["by_device"]}
    assert set(devices) == {"cpu", "cuda:0"}
    assert devices["cuda:0"]["usd_per_hour"] == 2.5
    # the CSV rows sum back exactly to the JSON totals
    parsed = list(csv.DictReader(io.StringIO(cost_csv(rows, PRICES).decode())))
    assert [int(r["line"]) for r in parsed] == list(range(1, 41))
    assert math.fsum(float(r["cost_usd"]) for r in parsed) == report["cost"]["usd"]
    assert sum(int(r["completion_tokens"]) for r in parsed) == report["tokens"]["completion_tokens"]
    assert math.fsum(float(r["engine_seconds"]) for r in parsed) == report["engine_seconds"]
    assert sum(tl["requests"] for tl in report["timeline"]) == 40
    assert sum(tl["completion_tokens"] for tl in report["timeline"]) == report["tokens"]["completion_tokens"]


def test_prices_savings_and_per_million():
    rows = [usage(1, prompt=1_000_000, cached=400_000, completion=500_000, secs=3600.0)]
    report = build_cost_report(rows, PRICES, batch_id="b")
    assert report["cost"]["usd"] == pytest.approx(0.12)
    assert report["cost"]["usd_per_1m_input_tokens"] == pytest.approx(0.12)
    assert report["cost"]["usd_per_1m_output_tokens"] == pytest.approx(0.24)
    online = 0.6 * 0.15 + 0.4 * 0.075 + 0.5 * 0.60
    assert report["savings"]["online_list_usd"] == pytest.approx(online)
    assert report["savings"]["vs_online_list_usd"] == pytest.approx(online - 0.12)
    assert report["savings"]["cache_usd"] == pytest.approx(0.4 * 0.15)
    assert report["tokens"]["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert report["queue_seconds"] == {"mean": 1.0, "max": 1.0}
    assert report["wall_seconds"] == 2.0


def test_device_price_lookup_and_missing_price():
    prices = Prices({"cuda": 2.0, "default": 1.0}, 0, 0, 0)
    assert prices.hourly_price("cuda:1") == 2.0
    assert prices.hourly_price("cpu") == 1.0
    # an unpriced device does not break finalize: it is listed, and costs nothing in the sum
    unpriced = Prices({"cpu": 1.0}, 0, 0, 0)
    assert request_cost_usd(usage(1, device="tpu"), unpriced) == 0.0
    report = build_cost_report([usage(1, device="tpu"), usage(2, device="cpu", secs=36.0)],
                               unpriced, batch_id="b")
    assert report["unpriced_devices"] == ["tpu"]
    assert report["cost"]["usd"] == 0.01
    assert build_cost_report([usage(1)], PRICES, batch_id="b")["unpriced_devices"] == []


def test_empty_batch_report():
    report = build_cost_report([], PRICES, batch_id="b")
    assert report["cost"]["usd"] == 0.0
    assert report["cost"]["usd_per_1m_input_tokens"] is None
    assert report["timeline"] == []
    assert cost_csv([], PRICES).decode().count("\n") == 1

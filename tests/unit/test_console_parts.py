"""The console's pure parts: the throughput meter over /metrics' counters, the days of a cost
window, the daily chart and the formatting the pages share."""
from __future__ import annotations

from nightshift.api.console.health import ThroughputMeter, health_view
from nightshift.api.console.rendering import duration, when
from nightshift.jobs.costs.daily_costs import DAY, every_day
from nightshift.jobs.costs.html_page import daily_costs_chart


class Counters:
    def __init__(self):
        self.now, self.tokens = 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def read(self) -> dict[str, float]:
        return {"completion_tokens": self.tokens, "prompt_tokens": 2 * self.tokens, "requests": self.tokens / 10}


def test_throughput_needs_two_readings_then_rates_over_the_window():
    c = Counters()
    meter = ThroughputMeter(c.read, c.clock)
    first = meter.rates()
    assert first["completion_tokens_per_second"] is None and first["window_seconds"] is None
    c.now, c.tokens = 5.0, 500.0
    second = meter.rates()
    assert second["completion_tokens_per_second"] == 100.0 and second["prompt_tokens_per_second"] == 200.0
    assert second["requests_per_second"] == 10.0 and second["window_seconds"] == 5.0
    for step in range(1, 30):                      # 5 s apart for 145 s more, 50 tokens/s
        c.now, c.tokens = 5.0 + 5 * step, 500.0 + 250 * step
        rates = meter.rates()
    assert rates["completion_tokens_per_second"] == 50.0 and 60 <= rates["window_seconds"] <= 65
    assert len(meter.readings) <= 14                                    # old readings dropped
    c.now += 0.2
    meter.rates()
    assert len(meter.readings) <= 14            # readings closer than a second apart are not kept
    c.now, c.tokens = c.now + 5, 0.0            # the counters were reset (their files emptied)
    assert meter.rates()["completion_tokens_per_second"] is None


def test_health_view_words():
    view = health_view({"completion_tokens_per_second": 12.345, "prompt_tokens_per_second": None,
                        "requests_per_second": 0.0, "completion_tokens_total": 1234.0, "prompt_tokens_total": 9.0,
                        "requests_total": 5.0, "window_seconds": 10.0}, {"gpu": 3, "cpu": 0})
    assert view["throughput"]["completion"] == "12.3 output tokens/s" and view["throughput"]["prompt"] == "measuring…"
    assert view["throughput"]["window"] == "over the last 10 s"
    assert view["throughput"]["totals"] == "1,234 output tokens, 5 requests so far"
    assert view["queues"] == {"gpu": "3", "cpu": "0", "upkeep": "unknown"}       # a queue the broker could not read


def test_every_day_of_the_window_with_empty_days_at_zero():
    report = {"project_id": "p", "from": 20 * DAY + 3600, "to": 23 * DAY + 10, "data": [
        {"date": "1970-01-22", "cost_usd": 1.0, "online_list_usd": 3.0}]}
    days = every_day(report)
    assert [d["date"] for d in days] == ["1970-01-21", "1970-01-22", "1970-01-23", "1970-01-24"]
    assert days[1]["cost_usd"] == 1.0 and days[0]["cost_usd"] == days[3]["online_list_usd"] == 0.0
    svg = daily_costs_chart(days)
    assert svg.startswith("<svg") and svg.count("<rect") == 8 and "1970-01-22: cost $1.0000" in svg
    assert "No answered requests" in daily_costs_chart(every_day({**report, "data": []}))


def test_formatting():
    from nightshift.jobs.costs.formatting import money
    assert [money(v) for v in (None, 0.000089, -0.000026, 12.5, -3.25)] == \
        ["-", "$0.000089", "-$0.000026", "$12.5000", "-$3.2500"]
    assert [duration(s) for s in (None, 0, 59.6, 61, 3600 * 2 + 300)] == ["-", "0s", "1m 00s", "1m 01s", "2h 05m"]
    assert when(0) == "1970-01-01 00:00:00 UTC" and when(None) == "-"

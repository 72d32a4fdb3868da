"""How a cost report reads to a person: money and number formatting and the labelled rows,
shared by the terminal table (``nightshift cost``) and the HTML page, so both say the same."""
from __future__ import annotations

from typing import Optional, Union

MISSING = "-"
DEVICE_COLUMNS = ("Device", "Requests", "Engine s", "$ / hour", "Cost")


def money(value: Optional[float]) -> str:
    """Dollars; sub-cent amounts keep six decimals, since per-request costs are that small; a
    negative amount (savings when the engine cost more than the online list price) as -$x."""
    if value is None:
        return MISSING
    sign = "-" if value < 0 else ""
    return f"{sign}${abs(value):,.6f}" if abs(value) < 0.01 else f"{sign}${abs(value):,.4f}"


def number(value: Union[int, float, None]) -> str:
    if value is None:
        return MISSING
    return f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"


def _share(part: Optional[float]) -> str:
    return f" ({part:.1%})" if part is not None else ""


def key_figures(report: dict) -> list[tuple[str, str]]:
    """(label, value) rows of a cost.json document's headline numbers."""
    tokens, cost, savings, requests = report["tokens"], report["cost"], report["savings"], report["requests"]
    saved_pct = savings["vs_online_list_pct"]
    return [
        ("Requests", f"{requests['total']:,} ({requests['completed']:,} completed, {requests['failed']:,} failed)"),
        ("Prompt tokens", number(tokens["prompt_tokens"])),
        ("  from the prefix cache", number(tokens["cached_prompt_tokens"]) + _share(tokens["prefix_cache_hit_rate"])),
        ("Completion tokens", number(tokens["completion_tokens"])),
        ("Engine seconds", number(float(report["engine_seconds"]))),
        ("Cost", money(cost["usd"])),
        ("$ / 1M input tokens", money(cost["usd_per_1m_input_tokens"])),
        ("$ / 1M output tokens", money(cost["usd_per_1m_output_tokens"])),
        ("Cache savings (list price)", money(savings["cache_usd"])),
        ("Online list price", money(savings["online_list_usd"])),
        ("Savings vs online", money(savings["vs_online_list_usd"])
         + (f" ({saved_pct:.1f}%)" if saved_pct is not None else "")),
    ]


def device_rows(report: dict) -> list[tuple[str, str, str, str, str]]:
    """One row per device (see DEVICE_COLUMNS)."""
    return [(d["device"], number(d["requests"]), number(float(d["engine_seconds"])), money(d["usd_per_hour"]),
             money(d["usd"])) for d in report["by_device"]]

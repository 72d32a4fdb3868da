"""A one-file HTML page for a batch cost report: the key figures and an inline SVG chart of
tokens (bars) and cumulative dollars (line) over the job's timeline. No JavaScript, no
external assets, so it opens anywhere (`nightshift cost ID --html cost.html`)."""
from __future__ import annotations

from datetime import datetime, timezone
from html import escape
from typing import Optional

WIDTH, HEIGHT, PAD = 720, 260, 48


def _money(value: Optional[float]) -> str:
    if value is None:
        return "–"
    return f"${value:,.6f}" if abs(value) < 0.01 else f"${value:,.4f}"


def _num(value) -> str:  # noqa: ANN001
    if value is None:
        return "–"
    return f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"


def _chart(timeline: list[dict]) -> str:
    if not timeline:
        return "<p>No finished requests yet.</p>"
    tokens = [t["prompt_tokens"] + t["completion_tokens"] for t in timeline]
    cumulative, total = [], 0.0
    for t in timeline:
        total += t["usd"]
        cumulative.append(total)
    max_tokens, max_usd = max(tokens) or 1, cumulative[-1] or 1.0
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    step = inner_w / len(timeline)
    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
             'role="img" aria-label="tokens and cost over time">',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>']
    for i, (t, n) in enumerate(zip(timeline, tokens)):
        h = inner_h * n / max_tokens
        parts.append(f'<rect x="{PAD + i * step + 1:.1f}" y="{HEIGHT - PAD - h:.1f}" width="{max(step - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="#7aa6d8"><title>{_num(n)} tokens, {t["requests"]} requests'
                     f'</title></rect>')
    points = " ".join(f"{PAD + (i + 0.5) * step:.1f},{HEIGHT - PAD - inner_h * c / max_usd:.1f}"
                      for i, c in enumerate(cumulative))
    parts.append(f'<polyline points="{points}" fill="none" stroke="#d8572a" stroke-width="2"/>')
    start = datetime.fromtimestamp(timeline[0]["t"], timezone.utc).strftime("%H:%M:%S")
    end = datetime.fromtimestamp(timeline[-1]["t"], timezone.utc).strftime("%H:%M:%S")
    parts += [f'<text x="{PAD}" y="{HEIGHT - PAD + 18}" font-size="12">{start} UTC</text>',
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 18}" font-size="12" text-anchor="end">{end} UTC</text>',
              f'<text x="{PAD}" y="{PAD - 10}" font-size="12" fill="#3b6ea5">bars: tokens per interval '
              f'(max {_num(max_tokens)})</text>',
              f'<text x="{WIDTH - PAD}" y="{PAD - 10}" font-size="12" fill="#d8572a" text-anchor="end">'
              f'line: cumulative cost ({_money(cumulative[-1])})</text>', "</svg>"]
    return "\n".join(parts)


def render_cost_page(report: dict) -> str:
    tokens, cost, savings = report["tokens"], report["cost"], report["savings"]
    rows = [
        ("Status", escape(str(report.get("status")))),
        ("Requests", f'{report["requests"]["total"]:,} ({report["requests"]["completed"]:,} completed, '
                     f'{report["requests"]["failed"]:,} failed)'),
        ("Prompt tokens", f'{_num(tokens["prompt_tokens"])} ({_num(tokens["cached_prompt_tokens"])} from the prefix cache)'),
        ("Completion tokens", _num(tokens["completion_tokens"])),
        ("Engine seconds", _num(report["engine_seconds"])),
        ("Cost", _money(cost["usd"])),
        ("$ / 1M input tokens", _money(cost["usd_per_1m_input_tokens"])),
        ("$ / 1M output tokens", _money(cost["usd_per_1m_output_tokens"])),
        ("Cache savings (list price)", _money(savings["cache_usd"])),
        ("Online list price", _money(savings["online_list_usd"])),
        ("Savings vs online", _money(savings["vs_online_list_usd"])
         + (f' ({savings["vs_online_list_pct"]:.1f}%)' if savings["vs_online_list_pct"] is not None else "")),
    ]
    devices = "".join(f"<tr><td>{escape(d['device'])}</td><td>{d['requests']:,}</td>"
                      f"<td>{_num(d['engine_seconds'])}</td><td>{_money(d['usd_per_hour'])}/h</td>"
                      f"<td>{_money(d['usd'])}</td></tr>" for d in report["by_device"])
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Cost of {escape(report['batch_id'])}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
th,td{{text-align:left;padding:4px 12px;border-bottom:1px solid #ddd}}th{{font-weight:600}}</style></head>
<body><h1>Cost of {escape(report['batch_id'])}</h1>
<p>Model {escape(str(report.get('model')))} · amounts in {escape(report.get('currency', 'USD'))}</p>
{_chart(report.get("timeline") or [])}
<table>{table}</table>
<h2>By device</h2>
<table><tr><th>Device</th><th>Requests</th><th>Engine s</th><th>Price</th><th>Cost</th></tr>{devices}</table>
</body></html>
"""

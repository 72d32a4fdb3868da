"""A one-file HTML page for a batch cost report: the key figures and an inline SVG chart of
tokens (bars) and cumulative dollars (line) over the job's timeline. No JavaScript, no
external assets, so it opens anywhere (`nightshift cost ID --html cost.html`). The console
(api/console/) shows the same chart on a batch's page, and ``daily_costs_chart`` on its costs page."""
from __future__ import annotations

from datetime import datetime, timezone
from html import escape

from nightshift.jobs.costs.formatting import DEVICE_COLUMNS, device_rows, key_figures, money, number

WIDTH, HEIGHT, PAD = 720, 260, 48


def timeline_chart(timeline: list[dict]) -> str:
    """Inline SVG of a cost report's timeline (or a sentence while nothing has finished)."""
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
                     f'height="{h:.1f}" fill="#7aa6d8"><title>{number(n)} tokens, {t["requests"]} requests'
                     f'</title></rect>')
    points = " ".join(f"{PAD + (i + 0.5) * step:.1f},{HEIGHT - PAD - inner_h * c / max_usd:.1f}"
                      for i, c in enumerate(cumulative))
    parts.append(f'<polyline points="{points}" fill="none" stroke="#d8572a" stroke-width="2"/>')
    start = datetime.fromtimestamp(timeline[0]["t"], timezone.utc).strftime("%H:%M:%S")
    end = datetime.fromtimestamp(timeline[-1]["t"], timezone.utc).strftime("%H:%M:%S")
    parts += [f'<text x="{PAD}" y="{HEIGHT - PAD + 18}" font-size="12">{start} UTC</text>',
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 18}" font-size="12" text-anchor="end">{end} UTC</text>',
              f'<text x="{PAD}" y="{PAD - 10}" font-size="12" fill="#3b6ea5">bars: tokens per interval '
              f'(max {number(max_tokens)})</text>',
              f'<text x="{WIDTH - PAD}" y="{PAD - 10}" font-size="12" fill="#d8572a" text-anchor="end">'
              f'line: cumulative cost ({money(cumulative[-1])})</text>', "</svg>"]
    return "\n".join(parts)


def daily_costs_chart(days: list[dict]) -> str:
    """Inline SVG of a project's days (``costs_by_day``'s ``data``, one entry per day of the window,
    days without work included at zero): per day our cost (blue) beside what the same tokens cost at
    the online list prices (grey), on one dollar scale, so the gap is the saving."""
    if not any(d["cost_usd"] or d["online_list_usd"] for d in days):
        return "<p>No answered requests in this window.</p>"
    top = max(max(d["cost_usd"], d["online_list_usd"]) for d in days) or 1.0
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    step = inner_w / len(days)
    bar = max(step / 2 - 1, 1)
    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
             'role="img" aria-label="cost and online list price per day">',
             f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>']
    for i, d in enumerate(days):
        for j, (value, colour, what) in enumerate(((d["cost_usd"], "#3b6ea5", "cost"),
                                                   (d["online_list_usd"], "#b8b8b8", "online list price"))):
            h = inner_h * value / top
            parts.append(f'<rect x="{PAD + i * step + j * (bar + 1):.1f}" y="{HEIGHT - PAD - h:.1f}" '
                         f'width="{bar:.1f}" height="{h:.1f}" fill="{colour}"><title>{escape(d["date"])}: '
                         f'{what} {money(value)}</title></rect>')
    parts += [f'<text x="{PAD}" y="{HEIGHT - PAD + 18}" font-size="12">{escape(days[0]["date"])}</text>',
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 18}" font-size="12" text-anchor="end">'
              f'{escape(days[-1]["date"])}</text>',
              f'<text x="{PAD}" y="{PAD - 10}" font-size="12" fill="#3b6ea5">blue: our cost per day</text>',
              f'<text x="{WIDTH - PAD}" y="{PAD - 10}" font-size="12" fill="#777" text-anchor="end">'
              f'grey: online list price (max {money(top)})</text>', "</svg>"]
    return "\n".join(parts)


def _cells(tag: str, values) -> str:  # noqa: ANN001
    return "".join(f"<{tag}>{escape(v)}</{tag}>" for v in values)


def render_cost_page(report: dict) -> str:
    rows = [("Status", str(report.get("status")))] + key_figures(report)
    table = "".join(f"<tr><th>{escape(k.strip())}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    devices = "".join(f"<tr>{_cells('td', row)}</tr>" for row in device_rows(report))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Cost of {escape(report['batch_id'])}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
th,td{{text-align:left;padding:4px 12px;border-bottom:1px solid #ddd}}th{{font-weight:600}}</style></head>
<body><h1>Cost of {escape(report['batch_id'])}</h1>
<p>Model {escape(str(report.get('model')))} · amounts in {escape(report.get('currency', 'USD'))}</p>
{timeline_chart(report.get("timeline") or [])}
<table>{table}</table>
<h2>By device</h2>
<table><tr>{_cells('th', DEVICE_COLUMNS)}</tr>{devices}</table>
</body></html>
"""

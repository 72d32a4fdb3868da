"""`nightshift cost BATCH_ID`: a batch's cost report in the terminal (issue 6).

  nightshift cost BATCH_ID              key figures and the per-device split, as a table
  nightshift cost BATCH_ID --json       the cost.json document
  nightshift cost BATCH_ID --csv        cost.csv (one row per request; finished batches)
  nightshift cost BATCH_ID --html FILE  the cost page with its chart, to open in a browser
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from nightshift.api.cli_client import BatchClient, CLIError, resolve_api_key, resolve_base_url


class CostClient(BatchClient):
    def cost(self, batch_id: str) -> dict:
        return self._call("GET", f"/batches/{batch_id}/cost").json()


def _money(value) -> str:  # noqa: ANN001
    if value is None:
        return "-"
    return f"${value:,.6f}" if abs(value) < 0.01 else f"${value:,.4f}"


def render_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    tokens, cost, savings, requests = report["tokens"], report["cost"], report["savings"], report["requests"]
    hit = tokens["prefix_cache_hit_rate"]
    table = Table(title=f"cost of {report['batch_id']} ({report['status']})", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in [
        ("requests", f"{requests['total']:,} ({requests['completed']:,} completed, {requests['failed']:,} failed)"),
        ("prompt tokens", f"{tokens['prompt_tokens']:,}"),
        ("  from prefix cache", f"{tokens['cached_prompt_tokens']:,}" + (f" ({hit:.1%})" if hit is not None else "")),
        ("completion tokens", f"{tokens['completion_tokens']:,}"),
        ("engine seconds", f"{report['engine_seconds']:,.3f}"),
        ("cost", _money(cost["usd"])),
        ("$ / 1M input tokens", _money(cost["usd_per_1m_input_tokens"])),
        ("$ / 1M output tokens", _money(cost["usd_per_1m_output_tokens"])),
        ("cache savings (list price)", _money(savings["cache_usd"])),
        ("online list price", _money(savings["online_list_usd"])),
        ("savings vs online", _money(savings["vs_online_list_usd"])
         + (f" ({savings['vs_online_list_pct']:.1f}%)" if savings["vs_online_list_pct"] is not None else "")),
    ]:
        table.add_row(name, value)
    devices = Table(title="by device")
    for column in ("device", "requests", "engine s", "$/hour", "cost"):
        devices.add_column(column, justify="left" if column == "device" else "right")
    for d in report["by_device"]:
        devices.add_row(d["device"], f"{d['requests']:,}", f"{d['engine_seconds']:,.3f}",
                        _money(d["usd_per_hour"]), _money(d["usd"]))
    console = Console()
    console.print(table)
    if report["by_device"]:
        console.print(devices)
    if report.get("unpriced_devices"):
        console.print(f"[yellow]no price configured for {report['unpriced_devices']}: not in the cost[/yellow]")


def _cmd_cost(args: argparse.Namespace) -> int:
    client = CostClient(resolve_base_url(args.base_url), resolve_api_key(args.api_key))
    report = client.cost(args.batch_id)
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.csv:
        csv_id = (report.get("files") or {}).get("csv")
        if not csv_id:
            raise CLIError(f"batch {args.batch_id} is {report['status']}: cost.csv is written when it finishes")
        for chunk in client.file_content(csv_id):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    else:
        render_table(report)
    if args.html:
        from nightshift.jobs.cost_page import render_cost_page

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_cost_page(report))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def add_cost_command(sub, add_client_options: Callable[[argparse.ArgumentParser], None]) -> None:  # noqa: ANN001
    p = sub.add_parser("cost", help="print a batch's cost report (tokens, engine time, $, savings)")
    p.add_argument("batch_id")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print cost.json")
    output.add_argument("--csv", action="store_true", help="print cost.csv (one row per request)")
    p.add_argument("--html", metavar="FILE", help="also write the cost page with its chart to FILE")
    add_client_options(p)
    p.set_defaults(func=_cmd_cost)

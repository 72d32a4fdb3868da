"""`nightshift cost BATCH_ID`: a batch's cost report in the terminal.

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


def render_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from nightshift.jobs.costs.formatting import DEVICE_COLUMNS, device_rows, key_figures

    table = Table(title=f"cost of {report['batch_id']} ({report['status']})", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in key_figures(report):
        table.add_row(name, value)
    devices = Table(title="by device")
    for column in DEVICE_COLUMNS:
        devices.add_column(column, justify="left" if column == DEVICE_COLUMNS[0] else "right")
    for row in device_rows(report):
        devices.add_row(*row)
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
        from nightshift.jobs.costs.html_page import render_cost_page

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

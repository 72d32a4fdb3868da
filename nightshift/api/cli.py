"""The ``nightshift`` command.

  nightshift serve [--host H] [--port 8000]   API + Celery workers + beat, one process tree
  nightshift metrics [--port 9464]             serve this machine's worker metrics (no API here)
  nightshift migrate                           alembic upgrade head on the configured database; says what it did
  nightshift keys create --project NAME        print a new API key for the project
  nightshift keys list [--project NAME]        the keys (never their secrets)
  nightshift keys revoke KEY_ID                revoke a key: 401 from the next request on
  nightshift submit FILE [--endpoint E] [--wait]   upload + create a batch; prints the batch id (a file of
                                               Anthropic {"custom_id", "params"} requests: a message batch)
  nightshift retry BATCH_ID [--code C]... [--wait]   a new batch of the failed lines; prints its id
  nightshift status BATCH_ID [--anthropic]     the batch object as JSON (--anthropic: a message batch's)
  nightshift results BATCH_ID [--which all|output|errors] [--anthropic]   result lines to stdout
  nightshift cost BATCH_ID [--json|--csv] [--html FILE]   the batch's cost report
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from nightshift.api.cli_client import BatchClient, is_message_batch_file, resolve_api_key, resolve_base_url
from nightshift.api.cli_cost import add_cost_command


def _cmd_serve(args: argparse.Namespace) -> int:
    from nightshift.api.embedded import serve

    return serve(host=args.host, port=args.port, log_level=args.log_level)


def _cmd_metrics(args: argparse.Namespace) -> int:
    from nightshift.settings import get_settings
    from nightshift.workers.metrics import serve_metrics

    print(f"worker metrics at http://{args.host}:{args.port}/metrics", file=sys.stderr)
    try:
        serve_metrics(get_settings(), args.host, args.port)
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_migrate(_: argparse.Namespace) -> int:
    from nightshift.settings import get_settings
    from nightshift.migrations import upgrade_head

    print(upgrade_head(get_settings().resolved_database_url).describe())
    return 0


def _keys_database() -> str:
    from nightshift.migrations import upgrade_head
    from nightshift.settings import get_settings

    url = get_settings().resolved_database_url
    upgrade_head(url)
    return url


def _cmd_keys_create(args: argparse.Namespace) -> int:
    from nightshift.jobs.projects.api_keys import create_key
    from nightshift.storage.db import session_scope

    with session_scope(_keys_database()) as session:
        row, secret = create_key(session, args.project, name=args.name)
        key_id = row.id
    print(f"key {key_id} of project {args.project!r} (the secret below is shown only now)", file=sys.stderr)
    print(secret)
    return 0


def _cmd_keys_list(args: argparse.Namespace) -> int:
    from nightshift.jobs.projects.api_keys import list_keys
    from nightshift.storage.db import session_scope

    with session_scope(_keys_database()) as session:
        keys = list_keys(session, args.project)
    if args.json:
        print(json.dumps([{"id": k.id, "project": k.project, "name": k.name, "created_at": k.created_at,
                           "prefix": k.prefix or None, "revoked_at": k.revoked_at} for k in keys], indent=2))
        return 0
    rows = [("ID", "PROJECT", "NAME", "CREATED", "PREFIX", "REVOKED")]
    rows += [(k.id, k.project, k.name or "-", _when(k.created_at), k.prefix or "-",
              _when(k.revoked_at) if k.revoked_at is not None else "no") for k in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if not keys:
        print("(no keys" + (f" in project {args.project!r})" if args.project else ")"), file=sys.stderr)
    return 0


def _when(epoch: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    from nightshift.jobs.errors import NotFound
    from nightshift.jobs.projects.api_keys import revoke_key
    from nightshift.storage.db import session_scope

    try:
        with session_scope(_keys_database()) as session:
            row, revoked_now = revoke_key(session, args.key_id)
            when = _when(row.revoked_at)
    except NotFound:
        print(f"nightshift: no API key with id {args.key_id!r} (see `nightshift keys list`)", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id} at {when}" if revoked_now else f"{args.key_id} was already revoked at {when}")
    return 0


def _client(args: argparse.Namespace) -> BatchClient:
    return BatchClient(resolve_base_url(args.base_url), resolve_api_key(args.api_key))


def _cmd_submit(args: argparse.Namespace) -> int:
    client = _client(args)
    if is_message_batch_file(args.file):       # Anthropic's face: {"custom_id", "params"} requests
        return _report(client, client.submit_messages(args.file), args)
    return _report(client, client.submit(args.file, endpoint=args.endpoint), args)


def _cmd_retry(args: argparse.Namespace) -> int:
    client = _client(args)
    return _report(client, client.retry(args.batch_id, error_codes=args.code or None), args)


def _report(client: BatchClient, batch: dict, args: argparse.Namespace) -> int:
    """Print the batch id (after waiting for it to end, with --wait); non-zero if it did not complete."""
    if args.wait:
        batch = client.wait(batch["id"], show_progress=not args.quiet)
        print(f"batch {batch['id']}: {batch['status']}, request_counts {batch['request_counts']}", file=sys.stderr)
        for error in (batch.get("errors") or {}).get("data", []):
            print(f"  line {error.get('line')}: {error.get('message')} [{error.get('code')}]", file=sys.stderr)
    print(batch["id"])
    return 0 if batch["status"] not in ("failed", "expired", "cancelled") else 1


def _cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    batch = client.message_batch(args.batch_id) if args.anthropic else client.batch(args.batch_id)
    print(json.dumps(batch, indent=2))
    return 0


def _cmd_results(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.anthropic:
        out = sys.stdout.buffer
        for chunk in client.message_batch_results(args.batch_id):
            out.write(chunk)
        out.flush()
        return 0
    batch = client.batch(args.batch_id)
    if not (batch.get("output_file_id") or batch.get("error_file_id")):
        print(f"batch {batch['id']} is {batch['status']}: no result files (yet)", file=sys.stderr)
        return 1
    wanted = {"all": ("output_file_id", "error_file_id"), "output": ("output_file_id",),
              "errors": ("error_file_id",)}[args.which]
    out = sys.stdout.buffer
    for field in wanted:
        if batch.get(field):
            for chunk in client.file_content(batch[field]):
                out.write(chunk)
    out.flush()
    return 0


def _add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="API base, e.g. http://127.0.0.1:8000/v1 (env NIGHTSHIFT_BASE_URL)")
    p.add_argument("--api-key", help="API key (env NIGHTSHIFT_API_KEY; default: the local server's key)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nightshift", description="Self-hosted OpenAI-compatible batch inference")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run API, workers and beat (embedded default: no services needed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("NIGHTSHIFT_PORT", "8000")))
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("metrics", help="serve the Prometheus metrics of this machine's workers (for hosts without the API)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9464)
    p.set_defaults(func=_cmd_metrics)

    p = sub.add_parser("migrate", help="alembic upgrade head on the configured database")
    p.set_defaults(func=_cmd_migrate)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="create a key for a project (the project is created if new)")
    p.add_argument("--project", required=True)
    p.add_argument("--name", default=None, help="a label for the key")
    p.set_defaults(func=_cmd_keys_create)
    p = keys.add_parser("list", help="list keys (id, project, name, created, prefix, revoked); never a secret")
    p.add_argument("--project", default=None, help="only this project's keys")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=_cmd_keys_list)
    p = keys.add_parser("revoke", help="revoke a key by id: it is refused (401) from the next request on")
    p.add_argument("key_id")
    p.set_defaults(func=_cmd_keys_revoke)

    p = sub.add_parser("submit", help="upload a JSONL file and create a batch; prints the batch id")
    p.add_argument("file")
    p.add_argument("--endpoint", default=None, help="default: the url of the file's first line")
    p.add_argument("--wait", action="store_true", help="wait for the batch to finish, with a progress bar")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_client_options(p)
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("retry", help="run the failed lines of an ended batch again as a new batch; prints its id")
    p.add_argument("batch_id")
    p.add_argument("--code", action="append", metavar="ERROR_CODE",
                   help="only lines with this error code (repeatable), e.g. batch_expired; default: every failed line")
    p.add_argument("--wait", action="store_true", help="wait for the new batch to finish, with a progress bar")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_client_options(p)
    p.set_defaults(func=_cmd_retry)

    p = sub.add_parser("status", help="print the batch object")
    p.add_argument("batch_id")
    p.add_argument("--anthropic", action="store_true", help="a message batch as Anthropic's API shows it")
    _add_client_options(p)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("results", help="print the batch's result lines (output, then errors)")
    p.add_argument("batch_id")
    p.add_argument("--which", choices=("all", "output", "errors"), default="all")
    p.add_argument("--anthropic", action="store_true", help="a message batch's results as Anthropic's result lines")
    _add_client_options(p)
    p.set_defaults(func=_cmd_results)

    add_cost_command(sub, _add_client_options)   # nightshift cost BATCH_ID
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""What is waiting in a broker queue, read without taking it: the reconciler re-sends a pending
shard's wake-up only when it is not waiting there (lost with a Redis restart, or taken by a
worker that died), instead of re-sending every shard that has waited a while.

Only messages still waiting count; a message a worker has taken (Redis keeps it in its unacked
set until the task ends) does not, so a shard whose message died with its worker is re-sent
even though Redis would restore that message much later. Reads Redis lists and the embedded
broker's message files; for any other broker it answers None (the reconciler then goes by age).
"""
from __future__ import annotations

import base64
import json
import logging
import os
from typing import Iterable, Optional

log = logging.getLogger(__name__)


def queued_task_args(app, queue: str, task_name: Optional[str]) -> Optional[list[list]]:  # noqa: ANN001
    """The positional args of each ``task_name`` message (any task if None) waiting in
    ``queue``; None if this broker's queue cannot be read."""
    url = app.conf.broker_url or ""
    try:
        if url.startswith("filesystem"):
            raw = _filesystem_messages(app.conf.broker_transport_options, queue)
        elif url.startswith(("redis://", "rediss://")):
            raw = _redis_messages(app, queue)
        else:
            return None
    except Exception:  # the broker is down: nothing can be said about the queue now
        log.exception("could not read the %s queue", queue)
        return None
    return [args for args in (_task_args(message, task_name) for message in raw) if args is not None]


def _filesystem_messages(options: dict, queue: str) -> Iterable[bytes]:
    folder = options["data_folder_in"]
    suffix = f".{queue}.msg"
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.endswith(suffix) and name.partition(".")[2] == suffix[1:]:
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    yield f.read()
            except FileNotFoundError:   # taken by a worker meanwhile
                continue


def _redis_messages(app, queue: str) -> list[bytes]:  # noqa: ANN001
    with app.connection_for_read() as conn:
        client = conn.default_channel.client
        return client.lrange(queue, 0, -1)


def _task_args(raw: bytes, task_name: Optional[str]) -> Optional[list]:
    try:
        message = json.loads(raw)
        if task_name is not None and message.get("headers", {}).get("task") != task_name:
            return None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return list(args)
    except (ValueError, KeyError, IndexError, TypeError):
        return None

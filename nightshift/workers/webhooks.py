"""Sending webhook deliveries: claim what is due (one transaction), POST each signed payload
with no transaction open (a few at a time, each bounded by webhook_timeout_seconds), record
every attempt (one transaction each). A failed delivery is retried with exponential backoff
until webhook_max_attempts; the beat sends this task every webhook_tick_seconds and an ended
batch sends it at once."""
from __future__ import annotations

import concurrent.futures
import logging
import time

import httpx
import orjson

from nightshift.jobs.webhooks.delivery import DueDelivery, claim_due, record_attempt, sign
from nightshift.settings import Settings
from nightshift.storage.db import session_scope

log = logging.getLogger(__name__)
USER_AGENT = "Nightshift-Webhooks/1"
PARALLEL_SENDS = 8


def deliver_due_webhooks(settings: Settings, limit: int = 64) -> dict[str, int]:
    url = settings.resolved_database_url
    with session_scope(url) as s:
        due = claim_due(s, limit, settings.webhook_timeout_seconds)
    outcomes: dict[str, int] = {}
    if not due:
        return outcomes
    with httpx.Client(timeout=settings.webhook_timeout_seconds, headers={"user-agent": USER_AGENT},
                      follow_redirects=False) as client, \
            concurrent.futures.ThreadPoolExecutor(min(PARALLEL_SENDS, len(due))) as pool:
        for state in pool.map(lambda d: _send(client, d, settings), due):
            outcomes[state] = outcomes.get(state, 0) + 1
    return outcomes


def _send(client: httpx.Client, due: DueDelivery, settings: Settings) -> str:
    body = orjson.dumps(due.payload)
    timestamp = int(time.time())
    headers = {"content-type": "application/json", "webhook-id": due.event_id,
               "webhook-timestamp": str(timestamp), "webhook-signature": sign(due.secret, due.event_id, timestamp, body)}
    started, status_code, error = time.time(), None, None
    try:
        status_code = client.post(due.url, content=body, headers=headers).status_code
        if not 200 <= status_code < 300:
            error = f"HTTP {status_code}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:2000]
    with session_scope(settings.resolved_database_url) as s:
        state = record_attempt(s, due, started_at=started, seconds=time.time() - started, status_code=status_code,
                               error=error, max_attempts=settings.webhook_max_attempts,
                               retry_base_seconds=settings.webhook_retry_base_seconds)
    if error:
        log.warning("webhook %s attempt %d to %s: %s (%s)", due.event_id, due.attempt, due.url, error, state)
    return state

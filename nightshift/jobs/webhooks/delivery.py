"""Delivering: claiming due deliveries, signing them (Standard Webhooks, as OpenAI signs its
own), and recording each attempt with the backoff that follows a failure.

Signature: headers ``webhook-id`` (the event id), ``webhook-timestamp`` (Unix seconds) and
``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, keyed with the
base64-decoded part of the endpoint's ``whsec_`` secret. A receiver recomputes it, compares in
constant time, rejects timestamps far from its clock, and keeps event ids it has seen (a
delivery may arrive more than once)."""
from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from nightshift.jobs.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery, WebhookEndpoint


@dataclass(frozen=True)
class DueDelivery:
    delivery_id: int
    attempt: int
    url: str
    secret: str
    event_id: str
    payload: dict


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_seconds: float = 300,
           now: Optional[float] = None) -> bool:
    """What a receiver does (and the tests and the README's example use)."""
    now = time.time() if now is None else now
    try:
        timestamp = int(headers["webhook-timestamp"])
        expected = sign(secret, headers["webhook-id"], timestamp, body)
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_seconds:
        return False
    return any(hmac.compare_digest(expected, candidate) for candidate in headers.get("webhook-signature", "").split())


def claim_due(s: Session, limit: int, timeout_seconds: float, now: Optional[float] = None) -> list[DueDelivery]:
    """Due pending deliveries of enabled endpoints, each pushed out by the send's timeout while
    it is in flight (a sender that dies leaves it due again, so it is retried, never lost)."""
    now = time.time() if now is None else now
    rows = s.execute(select(WebhookDelivery, WebhookEndpoint)
                     .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
                     .where(WebhookDelivery.status == DeliveryStatus.PENDING, WebhookDelivery.next_attempt_at <= now,
                            WebhookEndpoint.enabled.is_(True))
                     .order_by(WebhookDelivery.next_attempt_at).limit(limit)
                     .with_for_update(of=WebhookDelivery, skip_locked=True)).all()
    due = []
    for delivery, endpoint in rows:
        delivery.attempts += 1
        delivery.next_attempt_at = now + 2 * timeout_seconds
        due.append(DueDelivery(delivery.id, delivery.attempts, endpoint.url, endpoint.secret, delivery.event_id,
                               delivery.payload))
    s.flush()
    return due


def retry_delay(attempt: int, base_seconds: float, max_seconds: float = 3600.0) -> float:
    """Exponential backoff: base, 2 x base, 4 x base, ... at most max_seconds."""
    return min(max_seconds, base_seconds * 2 ** (attempt - 1))


def record_attempt(s: Session, due: DueDelivery, *, started_at: float, seconds: float, status_code: Optional[int],
                   error: Optional[str], max_attempts: int, retry_base_seconds: float) -> str:
    """The attempt's row and the delivery's new state; returns that state."""
    s.add(WebhookAttempt(delivery_id=due.delivery_id, attempt=due.attempt, started_at=started_at, seconds=seconds,
                         status_code=status_code, error=error))
    ok = status_code is not None and 200 <= status_code < 300
    now = time.time()
    if ok:
        values = {"status": DeliveryStatus.DELIVERED, "delivered_at": now}
    elif due.attempt >= max_attempts:
        values = {"status": DeliveryStatus.FAILED}
    else:
        values = {"next_attempt_at": now + retry_delay(due.attempt, retry_base_seconds)}
    s.execute(update(WebhookDelivery).where(WebhookDelivery.id == due.delivery_id)
              .values(last_status_code=status_code, last_error=error, **values))
    return values.get("status", DeliveryStatus.PENDING)

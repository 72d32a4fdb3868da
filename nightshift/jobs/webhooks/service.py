"""Webhook endpoints as the API manages them: create (the signing secret is shown once), list,
get, update, delete, and an endpoint's recent deliveries with their attempts."""
from __future__ import annotations

import base64
import secrets
import time
from typing import Any, Optional
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session

from nightshift.jobs.errors import InvalidInput, NotFound
from nightshift.jobs.ids import new_id
from nightshift.jobs.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "schedule_run.failed")
MAX_ENDPOINTS_PER_PROJECT = 16


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or len(url) > 2048:
        raise InvalidInput("url must be an http(s) URL of at most 2048 characters.", "url", "invalid_value")
    return url


def _check_events(events: Optional[list[str]]) -> list[str]:
    if events is None:
        return list(EVENT_TYPES)
    unknown = [e for e in events if e not in EVENT_TYPES]
    if unknown or not events:
        raise InvalidInput(f"events must be a non-empty list of: {', '.join(EVENT_TYPES)} (got {unknown or events}).",
                           "events", "invalid_value")
    return list(dict.fromkeys(events))


def new_secret() -> str:
    """A Standard Webhooks signing secret: "whsec_" + base64 of 32 random bytes (the HMAC key)."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def create_endpoint(s: Session, project_id: str, *, url: str, events: Optional[list[str]] = None,
                    description: Optional[str] = None) -> WebhookEndpoint:
    count = len(s.scalars(select(WebhookEndpoint.id).where(WebhookEndpoint.project_id == project_id)).all())
    if count >= MAX_ENDPOINTS_PER_PROJECT:
        raise InvalidInput(f"A project can have at most {MAX_ENDPOINTS_PER_PROJECT} webhook endpoints.", None,
                           "limit_exceeded")
    endpoint = WebhookEndpoint(id=new_id("wh_"), project_id=project_id, url=_check_url(url),
                               secret=new_secret(), events=_check_events(events), description=description,
                               enabled=True, created_at=time.time())
    s.add(endpoint)
    s.flush()
    return endpoint


def get_endpoint(s: Session, project_id: str, endpoint_id: str) -> WebhookEndpoint:
    endpoint = s.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or endpoint.project_id != project_id:
        raise NotFound("webhook endpoint", endpoint_id)
    return endpoint


def list_endpoints(s: Session, project_id: str) -> list[WebhookEndpoint]:
    return list(s.scalars(select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id)
                          .order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)))


def update_endpoint(s: Session, endpoint: WebhookEndpoint, changes: dict[str, Any]) -> WebhookEndpoint:
    if changes.get("url") is not None:
        endpoint.url = _check_url(changes["url"])
    if "events" in changes:
        endpoint.events = _check_events(changes["events"])
    if "description" in changes:
        endpoint.description = changes["description"]
    if changes.get("enabled") is not None:
        endpoint.enabled = bool(changes["enabled"])
    s.flush()
    return endpoint


def delete_endpoint(s: Session, endpoint: WebhookEndpoint) -> None:
    s.delete(endpoint)
    s.flush()


def recent_deliveries(s: Session, endpoint: WebhookEndpoint, limit: int = 50
                      ) -> list[tuple[WebhookDelivery, list[WebhookAttempt]]]:
    deliveries = list(s.scalars(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)
                                .order_by(WebhookDelivery.id.desc()).limit(limit)))
    attempts: dict[int, list[WebhookAttempt]] = {d.id: [] for d in deliveries}
    if deliveries:
        for attempt in s.scalars(select(WebhookAttempt).where(WebhookAttempt.delivery_id.in_(list(attempts)))
                                 .order_by(WebhookAttempt.delivery_id, WebhookAttempt.attempt)):
            attempts[attempt.delivery_id].append(attempt)
    return [(d, attempts[d.id]) for d in deliveries]

"""Recording an event: one delivery row per enabled endpoint of the project that wants it,
written in the caller's transaction, the one that made the event happen (an outbox: the event
exists exactly when the state change does). The event id derives from what happened, so an
event recorded twice (a retried step) is one delivery."""
from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from nightshift.jobs.ids import derived_id
from nightshift.jobs.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint


def record_event(s: Session, project_id: str, event_type: str, subject_id: str, data: dict[str, Any],
                 now: float | None = None) -> int:
    """Queue ``event_type`` about ``subject_id`` (a batch or a schedule run) for the project's
    endpoints; returns how many deliveries were added."""
    now = time.time() if now is None else now
    endpoints = [e for e in s.scalars(select(WebhookEndpoint).where(WebhookEndpoint.project_id == project_id,
                                                                     WebhookEndpoint.enabled.is_(True)))
                 if event_type in e.events]
    if not endpoints:
        return 0
    event_id = derived_id("evt_", event_type, subject_id)
    payload = {"id": event_id, "object": "event", "type": event_type, "created_at": int(now), "data": data}
    insert = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    added = 0
    for endpoint in endpoints:
        inserted = s.execute(insert(WebhookDelivery).values(
            endpoint_id=endpoint.id, event_id=event_id, event_type=event_type, payload=payload,
            status=DeliveryStatus.PENDING, attempts=0, next_attempt_at=now, created_at=now)
            .on_conflict_do_nothing(index_elements=["endpoint_id", "event_id"]).returning(WebhookDelivery.id))
        added += len(inserted.all())
    return added

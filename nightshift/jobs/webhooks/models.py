"""Tables of webhooks: endpoints, one delivery per (endpoint, event), every attempt of it."""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from nightshift.jobs.orm import BigIntPK, Base, now
from nightshift.jobs.projects.models import Project


class DeliveryStatus:
    PENDING = "pending"          # waiting for its next attempt
    DELIVERED = "delivered"      # the receiver answered 2xx
    FAILED = "failed"            # gave up after webhook_max_attempts


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey(Project.id, ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    # The signing secret ("whsec_" + base64 key). Kept, since every delivery is signed with it; it is
    # shown once, when the endpoint is created.
    secret: Mapped[str] = mapped_column(String(128))
    events: Mapped[list[str]] = mapped_column(JSON)
    description: Mapped[Optional[str]] = mapped_column(String(512))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)


class WebhookDelivery(Base):
    """An event to deliver to one endpoint (written in the transaction that made the event
    happen, so no event is lost between the state change and the delivery)."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey(WebhookEndpoint.id, ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(64))        # the receiver's idempotency key (webhook-id)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float, default=now)
    last_status_code: Mapped[Optional[int]] = mapped_column(Integer)
    last_error: Mapped[Optional[str]] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    delivered_at: Mapped[Optional[float]] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("endpoint_id", "event_id"),
        Index("ix_webhook_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
    )


class WebhookAttempt(Base):
    __tablename__ = "webhook_attempts"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey(WebhookDelivery.id, ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float)
    status_code: Mapped[Optional[int]] = mapped_column(Integer)
    error: Mapped[Optional[str]] = mapped_column(Text)

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel


class WebhookCreate(BaseModel):
    url: str
    events: Optional[list[str]] = None          # default: every event type
    description: Optional[str] = None


class WebhookUpdate(BaseModel):
    url: Optional[str] = None
    events: Optional[list[str]] = None
    description: Optional[str] = None
    enabled: Optional[bool] = None


class WebhookObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    description: Optional[str] = None
    enabled: bool
    created_at: int
    secret: Optional[str] = None                # only in the answer to its creation


class WebhookDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class DeliveryAttemptObject(BaseModel):
    attempt: int
    started_at: float
    seconds: float
    status_code: Optional[int] = None
    error: Optional[str] = None


class DeliveryObject(BaseModel):
    id: int
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_id: str
    event_type: str
    status: str
    attempts: list[DeliveryAttemptObject]
    next_attempt_at: Optional[int] = None
    created_at: int
    delivered_at: Optional[int] = None

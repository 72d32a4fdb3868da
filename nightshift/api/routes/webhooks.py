"""/v1/webhooks: a project's webhook endpoints (create, list, get, update, delete) and their
recent deliveries with every attempt. The signing secret is in the answer to the creation only."""
from __future__ import annotations

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from nightshift.api.deps import CallerDep
from nightshift.api.schemas.common import ListPage
from nightshift.api.schemas.webhooks import (DeliveryAttemptObject, DeliveryObject, WebhookCreate, WebhookDeleted,
                                             WebhookObject, WebhookUpdate)
from nightshift.jobs.webhooks import service
from nightshift.jobs.webhooks.models import DeliveryStatus, WebhookEndpoint

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


def endpoint_object(endpoint: WebhookEndpoint, with_secret: bool = False) -> WebhookObject:
    return WebhookObject(id=endpoint.id, url=endpoint.url, events=list(endpoint.events),
                         description=endpoint.description, enabled=endpoint.enabled,
                         created_at=int(endpoint.created_at), secret=endpoint.secret if with_secret else None)


@router.post("", response_model=WebhookObject)
async def create_webhook(body: WebhookCreate, caller: CallerDep) -> WebhookObject:
    return await caller.run(lambda s, project_id: endpoint_object(service.create_endpoint(
        s, project_id, url=body.url, events=body.events, description=body.description), with_secret=True))


@router.get("", response_model=ListPage[WebhookObject])
async def list_webhooks(caller: CallerDep) -> ListPage[WebhookObject]:
    return await caller.read(lambda s, project_id: ListPage[WebhookObject].of(
        [endpoint_object(e) for e in service.list_endpoints(s, project_id)], False))


@router.get("/{endpoint_id}", response_model=WebhookObject)
async def retrieve_webhook(endpoint_id: str, caller: CallerDep) -> WebhookObject:
    return await caller.read(lambda s, project_id: endpoint_object(service.get_endpoint(s, project_id, endpoint_id)))


@router.post("/{endpoint_id}", response_model=WebhookObject)
async def update_webhook(endpoint_id: str, body: WebhookUpdate, caller: CallerDep) -> WebhookObject:
    changes = body.model_dump(exclude_unset=True)
    return await caller.run(lambda s, project_id: endpoint_object(service.update_endpoint(
        s, service.get_endpoint(s, project_id, endpoint_id), changes)))


@router.delete("/{endpoint_id}", response_model=WebhookDeleted)
async def delete_webhook(endpoint_id: str, caller: CallerDep) -> WebhookDeleted:
    await caller.run(lambda s, project_id: service.delete_endpoint(s, service.get_endpoint(s, project_id,
                                                                                            endpoint_id)))
    return WebhookDeleted(id=endpoint_id)


@router.get("/{endpoint_id}/deliveries", response_model=ListPage[DeliveryObject])
async def list_deliveries(endpoint_id: str, caller: CallerDep,
                          limit: int = Query(50, ge=1, le=500)) -> ListPage[DeliveryObject]:
    def page(s: Session, project_id: str) -> ListPage[DeliveryObject]:
        endpoint = service.get_endpoint(s, project_id, endpoint_id)
        items = [DeliveryObject(
            id=d.id, event_id=d.event_id, event_type=d.event_type, status=d.status, created_at=int(d.created_at),
            next_attempt_at=int(d.next_attempt_at) if d.status == DeliveryStatus.PENDING else None,
            delivered_at=int(d.delivered_at) if d.delivered_at is not None else None,
            attempts=[DeliveryAttemptObject(attempt=a.attempt, started_at=a.started_at, seconds=a.seconds,
                                            status_code=a.status_code, error=a.error) for a in attempts])
            for d, attempts in service.recent_deliveries(s, endpoint, limit)]
        return ListPage[DeliveryObject](data=items, has_more=False)

    return await caller.read(page)

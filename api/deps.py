"""Request-scoped dependencies: settings, a DB session, the object store, the caller's project."""
from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.errors import APIError
from jobs.keys import project_for_key
from jobs.settings import Settings, get_settings
from storage.db import get_sessionmaker
from storage.objectstore import ObjectStore, get_object_store


def _settings() -> Settings:
    return get_settings()


SettingsDep = Annotated[Settings, Depends(_settings)]


def _session(settings: SettingsDep) -> Iterator[Session]:
    """One session per request. Routes that write commit explicitly before they publish a
    Celery message (the message must not outrun the commit); anything else rolls back."""
    session = get_sessionmaker(settings.resolved_database_url)()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


SessionDep = Annotated[Session, Depends(_session)]


def _store(settings: SettingsDep) -> ObjectStore:
    return get_object_store(settings)


StoreDep = Annotated[ObjectStore, Depends(_store)]


def _masked(key: str) -> str:
    return key[:6] + "*" * 4 + key[-4:] if len(key) > 12 else "*" * len(key)


def _project_id(request: Request, session: SessionDep) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, "You didn't provide an API key. You need to provide your API key in an "
                            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    project_id = project_for_key(session, key)
    if project_id is None:
        raise APIError(401, f"Incorrect API key provided: {_masked(key)}.", code="invalid_api_key")
    return project_id


ProjectDep = Annotated[str, Depends(_project_id)]

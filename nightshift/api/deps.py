"""Request-scoped dependencies: settings, the object store, and the caller (API key + a way to
run database work as the caller's project). None of them holds a database connection: the
work passed to ``Caller.run`` opens and closes its own session in one thread (api/database.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Optional, Protocol, TypeVar

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from nightshift.api.database import RequestDatabase
from nightshift.api.errors import APIError
from nightshift.api.rate_limits import KeyProjects, key_hash
from nightshift.jobs.projects.api_keys import project_for_key
from nightshift.settings import Settings, get_settings
from nightshift.storage.objectstore import ObjectStore, get_object_store

T = TypeVar("T")


async def _settings() -> Settings:
    return get_settings()


SettingsDep = Annotated[Settings, Depends(_settings)]


async def _store(settings: SettingsDep) -> ObjectStore:
    return get_object_store(settings)


StoreDep = Annotated[ObjectStore, Depends(_store)]


async def _database(request: Request) -> RequestDatabase:
    return request.app.state.database


DatabaseDep = Annotated[RequestDatabase, Depends(_database)]


def _masked(key: str) -> str:
    return key[:6] + "*" * 4 + key[-4:] if len(key) > 12 else "*" * len(key)


class ProjectCaller(Protocol):
    """Whoever a request acts for, scoped to one project: the bearer of an API key (``Caller``)
    or a console session (api/console/sessions.py). ``run(work)`` calls ``work(session,
    project_id)`` in one database session, which commits when it returns."""

    database: RequestDatabase

    async def run(self, work: Callable[[Session, str], T], *, read_only: bool = False) -> T: ...

    async def read(self, work: Callable[[Session, str], T]) -> T: ...


@dataclass(frozen=True)
class Caller:
    """The bearer of an API key. ``run(work)`` resolves the key to its project and calls
    ``work(session, project_id)`` in the same session (401 for an unknown or revoked key);
    the session commits when ``work`` returns."""

    key: str
    database: RequestDatabase
    key_projects: Optional[KeyProjects] = None   # told each key's project (for the rate limits)

    async def run(self, work: Callable[[Session, str], T], *, read_only: bool = False) -> T:
        return await self.database.run(lambda session: work(session, self._project(session)), read_only=read_only)

    async def read(self, work: Callable[[Session, str], T]) -> T:
        return await self.run(work, read_only=True)

    def _project(self, session: Session) -> str:
        project_id = project_for_key(session, self.key)
        if project_id is None:
            raise APIError(401, f"Incorrect API key provided: {_masked(self.key)}.", code="invalid_api_key")
        if self.key_projects is not None:
            self.key_projects.remember(key_hash(self.key), project_id)
        return project_id


async def _caller(request: Request, database: DatabaseDep) -> Caller:
    """The key of ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY``
    (Anthropic's; their ``anthropic-version`` header is accepted and needs nothing)."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        key = request.headers.get("x-api-key", "").strip()
    if not key:
        raise APIError(401, "You didn't provide an API key. You need to provide your API key in an "
                            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), "
                            "or in an x-api-key header.")
    return Caller(key, database, getattr(request.app.state, "key_projects", None))


CallerDep = Annotated[Caller, Depends(_caller)]

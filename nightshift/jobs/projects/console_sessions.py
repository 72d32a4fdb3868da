"""Console sessions: an API key exchanged for a browser session (api/console/).

The browser gets a random session token (256 bits) and never the key; the token is stored only
as its SHA-256, like keys. Each session has its own CSRF token, which every POST of the console
must send back. A session is valid while it has not expired and its key is not revoked: the
lookup joins the key, so a revoked key's sessions end at their next request (the caller then
calls ``end_session``). Functions take the caller's session and never commit.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import bindparam, delete, select
from sqlalchemy.orm import Session

from nightshift.jobs.projects.api_keys import hash_key, key_for_secret
from nightshift.jobs.projects.models import ApiKey, ConsoleSession, Project


@dataclass(frozen=True)
class SessionInfo:
    """What a page needs to know of its session: the project it sees and its CSRF token."""

    project_id: str
    project_name: str
    key_name: Optional[str]
    csrf_token: str
    expires_at: float


@dataclass(frozen=True)
class NewSession:
    token: str             # for the browser's cookie; only its hash is stored
    info: SessionInfo


def start_session(session: Session, key: str, *, lifetime_seconds: float, now: float) -> Optional[NewSession]:
    """A new console session for the bearer of ``key``; None for an unknown or revoked key.
    Sessions that have expired (anyone's) are deleted on the way."""
    found = key_for_secret(session, key)
    if found is None:
        return None
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
    token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    row = ConsoleSession(token_hash=hash_key(token), api_key_id=found.id, csrf_token=csrf, created_at=now,
                         expires_at=now + lifetime_seconds)
    session.add(row)
    session.flush()
    project = session.get(Project, found.project_id)
    return NewSession(token, SessionInfo(found.project_id, project.name, found.name, csrf, row.expires_at))


# Every console request runs this: built once, as a Core statement.
_sessions, _keys, _projects = ConsoleSession.__table__, ApiKey.__table__, Project.__table__
_LIVE_SESSION = (select(_keys.c.project_id, _projects.c.name, _keys.c.name, _sessions.c.csrf_token,
                        _sessions.c.expires_at)
                 .join(_keys, _keys.c.id == _sessions.c.api_key_id)
                 .join(_projects, _projects.c.id == _keys.c.project_id)
                 .where(_sessions.c.token_hash == bindparam("token_hash"), _keys.c.revoked_at.is_(None),
                        _sessions.c.expires_at > bindparam("now")))


def live_session(session: Session, token: str, now: float) -> Optional[SessionInfo]:
    """The session of ``token``, or None when there is none, it expired or its key was revoked."""
    row = session.execute(_LIVE_SESSION, {"token_hash": hash_key(token), "now": now}).first()
    return None if row is None else SessionInfo(*row)


def end_session(session: Session, token: str) -> bool:
    """Delete the session of ``token`` (logout, or one found expired or revoked); whether there was one."""
    return session.execute(delete(ConsoleSession).where(ConsoleSession.token_hash == hash_key(token))).rowcount > 0

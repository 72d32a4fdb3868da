"""Console sessions on the HTTP side: the cookie, the caller that resolves it to its project on
every unit of database work, and the CSRF check of actions.

The browser holds only a random session token in an HttpOnly, SameSite=Strict cookie (Secure
when the page was served over HTTPS); the API key it logged in with is never stored in it. The
session is looked up with every unit of work, in the same database session as the work
(jobs/projects/console_sessions.py), so a revoked key or an ended session stops the very next
request. An action (POST) also sends the session's CSRF token (form field or header), checked in
that same lookup before the action's work runs. The login form is protected by its own token,
sent as a short-lived cookie and in the form (double submit), so another site cannot log a
browser in to its own project either.
"""
from __future__ import annotations

import hmac
import secrets
import time
from typing import Annotated, Callable, Optional, TypeVar

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from nightshift.api.database import RequestDatabase
from nightshift.api.deps import DatabaseDep
from nightshift.jobs.projects.console_sessions import SessionInfo, end_session, live_session

T = TypeVar("T")

PREFIX = "/console"
LOGIN_PATH = f"{PREFIX}/login"
SESSION_COOKIE = "nightshift_console"
LOGIN_COOKIE = "nightshift_console_login"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
LOGIN_FORM_SECONDS = 3600


class SessionEnded(Exception):
    """No live console session: no cookie, logged out, expired, or its key was revoked."""


class CsrfRejected(Exception):
    """An action without its session's CSRF token (or a login without the login form's)."""


class SessionCaller:
    """A console session acting for its project: ``run(work)`` calls ``work(session,
    project_id)`` as ``deps.Caller`` does for an API key (api/deps.ProjectCaller), looking the
    session up in the same database session first. With ``csrf_sent`` (an action) the token must
    be the session's, or nothing runs. After a call, ``info`` holds the session's details."""

    def __init__(self, token: str, database: RequestDatabase, csrf_sent: Optional[str] = None):
        self.token, self.database, self.csrf_sent = token, database, csrf_sent
        self.info: Optional[SessionInfo] = None

    async def run(self, work: Callable[[Session, str], T], *, read_only: bool = False) -> T:
        return await self.database.run(lambda session: work(session, self._project(session)), read_only=read_only)

    async def read(self, work: Callable[[Session, str], T]) -> T:
        return await self.run(work, read_only=True)

    async def project(self) -> SessionInfo:
        """Only the session (a page that reads nothing else of the database)."""
        await self.read(lambda session, project_id: project_id)
        return self.info

    def _project(self, session: Session) -> str:
        info = live_session(session, self.token, time.time())
        if info is None:
            raise SessionEnded()
        if self.csrf_sent is not None and not hmac.compare_digest(self.csrf_sent.encode(), info.csrf_token.encode()):
            raise CsrfRejected()
        self.info = info
        return info.project_id


def session_token(request: Request) -> str:
    token = request.cookies.get(SESSION_COOKIE, "")
    if not token:
        raise SessionEnded()
    return token


async def _viewer(request: Request, database: DatabaseDep) -> SessionCaller:
    return SessionCaller(session_token(request), database)


async def _actor(request: Request, database: DatabaseDep) -> SessionCaller:
    """An action's caller: its CSRF token from the X-CSRF-Token header (the pages' script) or
    the form's csrf_token field; missing, it is refused before any work."""
    token = session_token(request)
    sent = request.headers.get(CSRF_HEADER)
    if sent is None:
        form = await request.form()
        value = form.get(CSRF_FIELD)
        sent = value if isinstance(value, str) else None
    if not sent:
        raise CsrfRejected()
    return SessionCaller(token, database, csrf_sent=sent)


ViewerDep = Annotated[SessionCaller, Depends(_viewer)]     # pages and polls
ActorDep = Annotated[SessionCaller, Depends(_actor)]       # POST actions (CSRF checked)


async def forget_session(request: Request, database: RequestDatabase) -> None:
    """Delete the request's session row, if it sent one (logout, or a session found ended)."""
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        await database.run(lambda session: end_session(session, token))


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def set_session_cookie(response: Response, request: Request, token: str, max_age: float) -> None:
    response.set_cookie(SESSION_COOKIE, token, max_age=int(max_age), path=PREFIX, httponly=True,
                        samesite="strict", secure=_secure(request))


def clear_session_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(SESSION_COOKIE, path=PREFIX, httponly=True, samesite="strict", secure=_secure(request))


def new_login_token() -> str:
    return secrets.token_urlsafe(32)


def set_login_cookie(response: Response, request: Request, token: str) -> None:
    """The login form's token as a cookie (sent back only by this site's own form); the form holds it too."""
    response.set_cookie(LOGIN_COOKIE, token, max_age=LOGIN_FORM_SECONDS, path=LOGIN_PATH, httponly=True,
                        samesite="strict", secure=_secure(request))


def check_login_token(request: Request, sent: Optional[str]) -> None:
    expected = request.cookies.get(LOGIN_COOKIE, "")
    if not expected or not sent or not hmac.compare_digest(expected.encode(), sent.encode()):
        raise CsrfRejected()

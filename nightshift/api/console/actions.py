"""The console's actions (POST): log in and out, cancel a batch, retry its failed lines, turn a
schedule off and on. Every action but the login carries the session's CSRF token (checked with
the session, before the work: sessions.py); each then answers with a redirect to the page that
shows its result. The batch actions are the JSON API's own (api/routes/batches.py)."""
from __future__ import annotations

import time
from urllib.parse import quote

from fastapi import APIRouter, Form, Request
from starlette.responses import RedirectResponse, Response

from nightshift.api.console.rendering import SECURITY_HEADERS, ConsoleRoute, render
from nightshift.api.console.sessions import (LOGIN_COOKIE, LOGIN_PATH, PREFIX, ActorDep, check_login_token,
                                             clear_session_cookie, forget_session, new_login_token,
                                             set_login_cookie, set_session_cookie)
from nightshift.api.deps import DatabaseDep, SettingsDep, StoreDep
from nightshift.api.routes import batches as batch_routes
from nightshift.jobs.projects.console_sessions import start_session
from nightshift.jobs.schedules import service as schedules
from nightshift.jobs.storable import unstorable_text
from nightshift.settings import Settings

router = APIRouter(prefix=PREFIX, route_class=ConsoleRoute)


def _see(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=SECURITY_HEADERS)


def login_form(request: Request, settings: Settings, *, status: int = 200, error: str = "") -> Response:
    token = new_login_token()
    response = render(request, "login.html", status=status, error=error, login_token=token,
                      session_hours=round(settings.console_session_seconds / 3600, 1))
    set_login_cookie(response, request, token)
    return response


@router.get("/login")
async def login_page(request: Request, settings: SettingsDep) -> Response:
    return login_form(request, settings)


@router.post("/login")
async def login(request: Request, database: DatabaseDep, settings: SettingsDep, api_key: str = Form(""),
                login_token: str = Form("")) -> Response:
    """Exchange an API key for a session cookie (the key is not kept)."""
    check_login_token(request, login_token)
    key = api_key.strip()
    if not key:
        return login_form(request, settings, status=400, error="Enter an API key.")
    started = None if unstorable_text(key) else await database.run(
        lambda session: start_session(session, key, lifetime_seconds=settings.console_session_seconds, now=time.time()))
    if started is None:
        return login_form(request, settings, status=401, error="That API key is not valid (unknown or revoked).")
    response = _see(PREFIX)
    set_session_cookie(response, request, started.token, settings.console_session_seconds)
    response.delete_cookie(LOGIN_COOKIE, path=LOGIN_PATH, httponly=True, samesite="strict")
    return response


@router.post("/logout")
async def logout(request: Request, caller: ActorDep) -> Response:
    await caller.project()                 # the session and its CSRF token
    await forget_session(request, caller.database)
    response = _see(LOGIN_PATH)
    clear_session_cookie(response, request)
    return response


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: ActorDep) -> Response:
    batch = await batch_routes.cancel(caller, batch_id)
    return _see(f"{PREFIX}/batches/{quote(batch.id)}")


@router.post("/batches/{batch_id}/retry")
async def retry_failed_lines(batch_id: str, caller: ActorDep, store: StoreDep, settings: SettingsDep) -> Response:
    """A new batch of the batch's failed lines; the page of the new batch."""
    batch = await batch_routes.retry(caller, store, settings, batch_id)
    return _see(f"{PREFIX}/batches/{quote(batch.id)}")


@router.post("/schedules/{schedule_id}/pause")
async def disable_schedule(schedule_id: str, caller: ActorDep) -> Response:
    await caller.run(lambda session, project_id: schedules.pause_schedule(
        session, schedules.get_schedule(session, project_id, schedule_id), now=time.time()))
    return _see(f"{PREFIX}/schedules")


@router.post("/schedules/{schedule_id}/resume")
async def enable_schedule(schedule_id: str, caller: ActorDep) -> Response:
    await caller.run(lambda session, project_id: schedules.resume_schedule(
        session, schedules.get_schedule(session, project_id, schedule_id), now=time.time()))
    return _see(f"{PREFIX}/schedules")

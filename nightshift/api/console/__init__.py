"""The batch console: server-rendered pages at /console for a person watching the project's
batches (list with live progress, one batch, schedules, costs, health), logged in with an API key
exchanged for a session cookie. A thin layer: every page calls the same jobs/ functions as the
JSON API, through the same kind of project-scoped caller (api/deps.ProjectCaller).

- ``sessions.py``: the login session (cookie, lookup per request, revoked keys), CSRF checks;
- ``rendering.py``: Jinja2 templates (package data), formatting, error pages, security headers;
- ``views.py``: what a page shows of a batch, pure functions shared by pages and live polls;
- ``health.py``: engine throughput from the /metrics counters;
- ``pages.py`` (GET pages), ``actions.py`` (login, logout, cancel, retry, schedules on/off),
  ``live.py`` (the JSON the pages poll); ``templates/`` and ``static/`` (CSS, one script).
"""
from __future__ import annotations

from fastapi import APIRouter
from starlette.staticfiles import StaticFiles

from nightshift.api.console import actions, live, pages

STATIC = StaticFiles(packages=[("nightshift.api.console", "static")])


def console_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    for part in (live.router, actions.router, pages.router):   # pages last: its catch-all 404
        router.include_router(part)
    return router

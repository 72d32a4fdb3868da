"""Pages from Jinja2 templates (package data: templates/), the formatting they share, and how the
console answers errors: an HTML page (or, under /console/api/, JSON for the pages' script) instead
of the API's OpenAI envelope; an ended session goes back to the login page.

Every console answer carries a strict Content-Security-Policy (scripts, styles and images from this
server only; the pages have no inline script or style), is never cached, and cannot be framed.
"""
from __future__ import annotations

import logging
import math
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from starlette.responses import JSONResponse, RedirectResponse, Response

from nightshift.api.console.sessions import (LOGIN_PATH, CsrfRejected, SessionEnded, clear_session_cookie,
                                             forget_session)
from nightshift.api.database import DatabaseUnavailable, Overloaded
from nightshift.api.errors import APIError
from nightshift.jobs.costs.formatting import MISSING, money, number
from nightshift.jobs.errors import Conflict, InvalidInput, NotFound

log = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
}


def when(seconds: Optional[float]) -> str:
    """Unix seconds as a UTC time."""
    if seconds is None:
        return MISSING
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: Optional[float]) -> str:
    """A span such as 2h 05m, 3m 20s or 12s."""
    if seconds is None or math.isnan(seconds):
        return MISSING
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def share(part: Optional[float]) -> str:
    return MISSING if part is None else f"{part:.1%}"


_environment = Environment(loader=PackageLoader("nightshift.api.console", "templates"),
                           autoescape=select_autoescape(default=True), undefined=StrictUndefined,
                           trim_blocks=True, lstrip_blocks=True)
_environment.filters.update(when=when, duration=duration, money=money, number=number, share=share)


def render(request: Request, template: str, *, status: int = 200, **context: Any) -> Response:
    """The template as an HTML answer; ``session`` (the SessionInfo, None on the login and error
    pages) and ``nav`` (the current section) are there for the layout."""
    context = {"session": None, "nav": None, **context}
    body = _environment.get_template(template).render(request=request, **context)
    return Response(body, status_code=status, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


def json_answer(content: Any, status: int = 200, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(content, status_code=status, headers={**SECURITY_HEADERS, **(headers or {})})


def _error(request: Request, status: int, title: str, message: str, headers: Optional[dict] = None) -> Response:
    if request.url.path.startswith("/console/api/"):
        return json_answer({"error": {"status": status, "title": title, "message": message}}, status, headers)
    response = render(request, "error.html", status=status, title=title, message=message)
    response.headers.update(headers or {})
    return response


async def _session_ended(request: Request) -> Response:
    await forget_session(request, request.app.state.database)
    if request.url.path.startswith("/console/api/"):
        response = json_answer({"error": {"status": 401, "title": "Logged out",
                                          "message": "Your console session has ended; log in again.",
                                          "login": LOGIN_PATH}}, 401)
    else:
        response = RedirectResponse(LOGIN_PATH, status_code=303, headers=SECURITY_HEADERS)
    clear_session_cookie(response, request)
    return response


def _invalid(exc: RequestValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ())[1:])
    return f"Invalid value for '{where}': {first.get('msg')}." if where else str(first.get("msg"))


class ConsoleRoute(APIRoute):
    """A console route: what the API would answer as an OpenAI error becomes a page (or the
    pages' JSON), with the same status code."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except SessionEnded:
                return await _session_ended(request)
            except CsrfRejected:
                return _error(request, 403, "Refused", "This action did not carry the page's security token "
                                                       "(CSRF). Reload the page and try again.")
            except NotFound as exc:
                return _error(request, 404, "Not found", str(exc))
            except InvalidInput as exc:
                return _error(request, 400, "Invalid input", exc.message)
            except RequestValidationError as exc:
                return _error(request, 400, "Invalid input", _invalid(exc))
            except Conflict as exc:
                return _error(request, 409, "Not possible now", exc.message)
            except APIError as exc:
                return _error(request, exc.status_code, "Refused", exc.message)
            except (Overloaded, DatabaseUnavailable) as exc:
                return _error(request, 503, "Busy", f"{exc} The page will work again shortly.",
                              {"retry-after": str(exc.retry_after_seconds)})

        return handle

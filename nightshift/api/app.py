"""The FastAPI application: OpenAI-compatible routes under /v1, errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import gc
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from sqlalchemy import text
from starlette.types import ASGIApp, Receive, Scope, Send

from nightshift.api.anthropic import routes as anthropic_routes
from nightshift.api.anthropic.errors import anthropic_response
from nightshift.api.console import STATIC as CONSOLE_STATIC
from nightshift.api.console import console_router
from nightshift.api.console.sessions import SESSION_COOKIE as CONSOLE_SESSION_COOKIE
from nightshift.api.database import RequestDatabase
from nightshift.api.deps import DatabaseDep
from nightshift.api.errors import error_response, install_error_handlers, refuse_unstorable_input
from nightshift.api.metrics import RequestMetrics, metrics_body, metrics_response, queue_depths, service_state
from nightshift.api.rate_limits import KeyProjects, RateLimits
from nightshift.api.routes import batches, costs, files, schedules, webhooks
from nightshift.jobs.projects.api_keys import ensure_key
from nightshift.settings import get_settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import get_object_store

UPLOAD_SLACK_BYTES = 1024 * 1024   # multipart framing around the file part


@asynccontextmanager
async def _lifespan(app: FastAPI):  # noqa: ANN202
    settings = get_settings()
    if settings.bootstrap_key:  # a known key for scripts and the embedded default
        with session_scope(settings.resolved_database_url) as session:
            ensure_key(session, settings.bootstrap_project, settings.bootstrap_key)
    get_object_store(settings)   # an unreachable or missing bucket stops the start, with the reason
    app.state.database = RequestDatabase(settings)
    app.state.database.open_connections()
    # What start-up built (modules, the S3 client's service model, the ORM's mappers) lives as
    # long as the process: out of the collector's sight, a full collection no longer walks it
    # and stalls every request in the worker meanwhile (60-230 ms each, measured under load).
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        app.state.database.close()


MESSAGE_BATCHES = "/v1/messages/batches"
UPLOAD_PATHS = ("/v1/files", MESSAGE_BATCHES)      # POST bodies that are stored: file uploads, message batches


class UploadGate:
    """Uploads (POST /v1/files, and message batches' create bodies), as a plain ASGI middleware (no per-request task or body copy):
    one whose declared length is over the limit is answered before its body is read, so it is
    never spooled; the others are taken ``api_concurrent_uploads`` at a time per process, the
    rest wait unread (their clients are held back by TCP). Parsing and storing a burst of
    uploads all at once would take the worker's CPU from every poll in the meantime: measured
    with bench.api_load (20 concurrent 1,000-line uploads beside 200 polling clients), the polls
    that arrived during the burst waited up to 200 ms for a database slot."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.slots: Optional[asyncio.Semaphore] = None     # made in the serving event loop ...
        self.loop: Optional[asyncio.AbstractEventLoop] = None   # ... this one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in UPLOAD_PATHS:
            settings = get_settings()
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if scope["path"] == MESSAGE_BATCHES:
                limit = settings.max_message_batch_bytes
                if declared.isdigit() and int(declared) > limit:
                    await anthropic_response(413, f"Request exceeds the maximum size of {limit} bytes for a message "
                                                  "batch.")(scope, receive, send)
                    return
            elif declared.isdigit() and int(declared) > settings.max_file_bytes + UPLOAD_SLACK_BYTES:
                response = error_response(400, f"File is larger than the limit of {settings.max_file_bytes} bytes.",
                                          param="file", code="file_too_large")
                await response(scope, receive, send)
                return
            if self.loop is not asyncio.get_running_loop():
                self.loop = asyncio.get_running_loop()
                self.slots = asyncio.Semaphore(settings.api_concurrent_uploads)
            async with self.slots:
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app() -> FastAPI:
    app = FastAPI(title="Nightshift", version="0.1.0", lifespan=_lifespan,
                  description="Self-hosted batch inference, OpenAI-compatible (/v1/files, /v1/batches) and "
                              "Anthropic-compatible (/v1/messages/batches).",
                  dependencies=[Depends(refuse_unstorable_input)])   # NUL in ids, queries, bodies: 404/400
    install_error_handlers(app)
    app.state.key_projects = KeyProjects()
    app.add_middleware(UploadGate)
    app.add_middleware(RateLimits, settings=get_settings(), key_projects=app.state.key_projects,
                       console_cookie=CONSOLE_SESSION_COOKIE)
    app.add_middleware(RequestMetrics)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(anthropic_routes.router)
    app.include_router(costs.router)
    app.include_router(schedules.router)
    app.include_router(webhooks.router)
    app.mount("/console/static", CONSOLE_STATIC, name="console-static")   # before the console's catch-all page
    app.include_router(console_router())

    @app.get("/metrics", include_in_schema=False)
    async def metrics(database: DatabaseDep) -> Response:
        state = await database.run(service_state, read_only=True)
        body = await run_in_threadpool(lambda: metrics_body(state, queue_depths()))
        return metrics_response(body)

    @app.get("/health", include_in_schema=False)
    async def health(database: DatabaseDep) -> dict:
        await database.run(lambda session: session.execute(text("SELECT 1")), read_only=True)
        return {"status": "ok"}

    return app

"""The FastAPI application: OpenAI-compatible routes under /v1, errors in OpenAI's shape."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from sqlalchemy import text
from starlette.types import ASGIApp, Receive, Scope, Send

from nightshift.api.database import RequestDatabase
from nightshift.api.deps import DatabaseDep
from nightshift.api.errors import error_response, install_error_handlers, refuse_unstorable_input
from nightshift.api.metrics import RequestMetrics, metrics_body, metrics_response, queue_depths, service_state
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
    yield


class RefuseOversizedUploads:
    """Answers an upload whose declared length is over the limit before its body is read, so
    it is never spooled (a plain ASGI middleware: no per-request task or body copy)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/files":
            declared = dict(scope["headers"]).get(b"content-length", b"")
            max_bytes = get_settings().max_file_bytes
            if declared.isdigit() and int(declared) > max_bytes + UPLOAD_SLACK_BYTES:
                response = error_response(400, f"File is larger than the limit of {max_bytes} bytes.",
                                          param="file", code="file_too_large")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app() -> FastAPI:
    app = FastAPI(title="Nightshift", version="0.1.0", lifespan=_lifespan,
                  description="Self-hosted, OpenAI-compatible batch inference (/v1/files, /v1/batches).",
                  dependencies=[Depends(refuse_unstorable_input)])   # NUL in ids, queries, bodies: 404/400
    install_error_handlers(app)
    app.add_middleware(RefuseOversizedUploads)
    app.add_middleware(RequestMetrics)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(costs.router)
    app.include_router(schedules.router)
    app.include_router(webhooks.router)

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

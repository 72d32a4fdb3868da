"""The FastAPI application: OpenAI-compatible routes under /v1, errors in OpenAI's shape."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from sqlalchemy import text

from api.errors import error_response, install_error_handlers
from api.routes import batches, costs, files, schedules
from jobs.keys import ensure_key
from jobs.settings import get_settings
from storage.db import get_engine, session_scope

UPLOAD_SLACK_BYTES = 1024 * 1024   # multipart framing around the file part


@asynccontextmanager
async def _lifespan(_: FastAPI):  # noqa: ANN202
    settings = get_settings()
    if settings.bootstrap_key:  # a known key for scripts and the embedded default
        with session_scope(settings.resolved_database_url) as session:
            ensure_key(session, settings.bootstrap_project, settings.bootstrap_key)
    yield


def create_app() -> FastAPI:
    app = FastAPI(title="Nightshift", version="0.1.0", lifespan=_lifespan,
                  description="Self-hosted, OpenAI-compatible batch inference (/v1/files, /v1/batches).")
    install_error_handlers(app)

    @app.middleware("http")
    async def refuse_oversized_uploads(request: Request, call_next):  # noqa: ANN001, ANN202
        # Answer before the body is read: a too-big upload is refused without being spooled.
        declared = request.headers.get("content-length", "")
        max_bytes = get_settings().max_file_bytes
        if request.method == "POST" and request.url.path == "/v1/files" and declared.isdigit() \
                and int(declared) > max_bytes + UPLOAD_SLACK_BYTES:
            return error_response(400, f"File is larger than the limit of {max_bytes} bytes.", param="file",
                                  code="file_too_large")
        return await call_next(request)

    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(costs.router)       # issue 6
    app.include_router(schedules.router)   # issue 6

    @app.get("/health", include_in_schema=False)
    def health() -> dict:
        with get_engine(get_settings().resolved_database_url).connect() as conn:
            conn.execute(text("SELECT 1"))
        return {"status": "ok"}

    return app

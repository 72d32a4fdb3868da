"""Anthropic's error envelope on its paths: ``{"type": "error", "error": {"type", "message"}}``.

The app's error handlers (api/errors.py) answer in OpenAI's shape; on a path under
``/v1/messages`` the answer is re-shaped here, so every error of these routes (validation, auth,
not found, conflicts, overload, unexpected) comes as the official ``anthropic`` client expects,
with Anthropic's type for the HTTP status. A field named in OpenAI's ``param`` leads the message,
as Anthropic writes it (``requests.3.custom_id: ...``).
"""
from __future__ import annotations

from typing import Any, Optional

import orjson
from fastapi.responses import JSONResponse

PATH_PREFIX = "/v1/messages"

TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                  422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                  529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_body(status_code: int, message: str) -> dict[str, Any]:
    kind = TYPE_BY_STATUS.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_response(status_code: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(anthropic_body(status_code, message), status_code=status_code, headers=headers)


def reshape(response: JSONResponse) -> JSONResponse:
    """An OpenAI-shaped error answer as Anthropic's (same status and headers)."""
    error = orjson.loads(response.body).get("error") or {}
    message = error.get("message") or "The request failed."
    param = error.get("param")
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return anthropic_response(response.status_code, message, headers)

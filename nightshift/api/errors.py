"""OpenAI error envelope: every error answer is {"error": {message, type, param, code}}.

The official client unwraps ``body["error"]`` and maps the status code to a typed
exception (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, ...).
It retries 409 and >=500 unless the answer carries ``x-should-retry: false``, so every
4xx carries that header: repeating the same call would get the same answer.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sqlalchemy.exc import TimeoutError as PoolTimeout

from nightshift.api.database import Overloaded
from nightshift.jobs.errors import Conflict, InvalidInput, NotFound

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


class APIError(Exception):
    """An error the API answers in OpenAI's shape."""

    def __init__(self, status_code: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")


def error_body(status_code: int, message: str, *, param=None, code=None, type=None) -> dict:  # noqa: A002
    return {"error": {"message": message,
                      "type": type or _TYPE_BY_STATUS.get(status_code, "server_error"),
                      "param": param, "code": code}}


def error_response(status_code: int, message: str, *, param=None, code=None, type=None,  # noqa: A002
                   headers: Optional[dict] = None) -> JSONResponse:
    headers = dict(headers or {})
    if status_code < 500:
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(error_body(status_code, message, param=param, code=code, type=type),
                        status_code=status_code, headers=headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, param=exc.param, code=exc.code, type=exc.type)


def _param_of(loc: tuple) -> Optional[str]:
    # loc is e.g. ("body", "metadata", "tags") or ("query", "limit"); OpenAI names the field.
    parts = loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "form") else loc
    return ".".join(str(p) for p in parts) or None


async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
    return error_response(404, str(exc), param=exc.param, code="not_found")


async def _invalid_input(_: Request, exc: InvalidInput) -> JSONResponse:
    return error_response(400, exc.message, param=exc.param, code=exc.code)


async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
    return error_response(409, exc.message, code=exc.code)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = _param_of(tuple(first.get("loc", ())))
    message = f"Invalid value for '{param}': {first.get('msg')}." if param else str(first.get("msg"))
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    if first.get("type") == "missing" and param:
        message = f"Missing required parameter: '{param}'."
    return error_response(400, message, param=param, code=code)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
    return error_response(503, str(exc), code="server_overloaded", type="server_error",
                          headers={"retry-after": str(exc.retry_after_seconds)})


async def _pool_timeout(_: Request, exc: PoolTimeout) -> JSONResponse:
    # Admission keeps pool checkouts within the pool's size, so this is rare (a database slow
    # to open connections); it is a busy server, not a broken request: retryable.
    return error_response(503, "The database is busy; retry after a short wait.", code="server_overloaded",
                          type="server_error", headers={"retry-after": "1"})


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, "The server had an error while processing your request.", type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(NotFound, _not_found)
    app.add_exception_handler(InvalidInput, _invalid_input)
    app.add_exception_handler(Conflict, _conflict)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Overloaded, _overloaded)
    app.add_exception_handler(PoolTimeout, _pool_timeout)
    app.add_exception_handler(Exception, _unexpected_error)

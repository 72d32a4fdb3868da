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

from sqlalchemy.exc import DataError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from nightshift.api.anthropic.errors import is_anthropic_path, reshape
from nightshift.api.database import DatabaseUnavailable, Overloaded
from nightshift.jobs.errors import Conflict, InvalidInput, NotFound
from nightshift.jobs.storable import unstorable_text, unstorable_value

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


# Pydantic error types that mean "the body as a whole is not a JSON object".
_NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc, kind = tuple(first.get("loc", ())), first.get("type")
    if kind == "json_invalid":   # loc is ("body", <character position>): not a parameter
        detail = (first.get("ctx") or {}).get("error")
        return error_response(400, "We could not parse the JSON body of your request: it is not valid JSON"
                              + (f" ({detail})." if detail else "."), code="invalid_json")
    if loc == ("body",):
        if kind == "missing":
            return error_response(400, "The request needs a JSON object body.", code="missing_required_parameter")
        if kind in _NOT_AN_OBJECT:
            return error_response(400, "The request body must be a JSON object (got "
                                  f"{_json_kind(first.get('input'))}).", code="invalid_type")
    param = _param_of(loc)
    message = f"Invalid value for '{param}': {first.get('msg')}." if param else str(first.get("msg"))
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    if kind == "missing" and param:
        message = f"Missing required parameter: '{param}'."
    return error_response(400, message, param=param, code=code)


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null" if value is None else type(value).__name__


async def _data_error(_: Request, exc: DataError) -> JSONResponse:
    # The database refused a value (too long for its column, out of range, a character it cannot
    # hold): the request's fault, not the server's. The checks at the edge should catch these
    # first; this keeps a missed one a 400 instead of a 500 and a dropped connection.
    reason = str(getattr(exc, "orig", None) or "").strip().splitlines()
    return error_response(400, "A value in the request cannot be stored"
                          + (f": {reason[0]}." if reason else "."), code="invalid_value")


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
    return error_response(503, str(exc), code="server_overloaded", type="server_error",
                          headers={"retry-after": str(exc.retry_after_seconds)})


async def _database_unavailable(_: Request, exc: DatabaseUnavailable) -> JSONResponse:
    return error_response(503, str(exc), code="service_unavailable", type="server_error",
                          headers={"retry-after": str(exc.retry_after_seconds)})


async def _pool_timeout(_: Request, exc: PoolTimeout) -> JSONResponse:
    # Admission keeps pool checkouts within the pool's size, so this is rare (a database slow
    # to open connections); it is a busy server, not a broken request: retryable.
    return error_response(503, "The database is busy; retry after a short wait.", code="server_overloaded",
                          type="server_error", headers={"retry-after": "1"})


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(500, "The server had an error while processing your request.", type="server_error")


async def refuse_unstorable_input(request: Request) -> None:
    """Every route's first dependency: strings no database can store (a NUL character, a lone
    surrogate) are refused before any database work, in one place for every route:

    - an id in the path holding one (or any control character) names nothing that can exist:
      404 ``not_found``, as for any unknown id;
    - a query parameter holding one: 400 naming the parameter;
    - a JSON body holding one in any string or key (or nested too deeply): 400 naming the
      field's path (``metadata.team``).
    Left alone, such a value reaches the database driver, which raises: a 500, a traceback in
    the log and a dropped connection. (Upload file names are checked by the upload itself.)"""
    for name, value in request.path_params.items():
        if isinstance(value, str) and _cannot_be_an_id(value):
            shown = value.encode("utf-8", "backslashreplace").decode().encode("unicode_escape").decode()
            raise NotFound(name[:-3] if name.endswith("_id") else name, shown)
    for name, value in request.query_params.multi_items():
        if unstorable_text(name):
            raise APIError(400, f"A query parameter's name {unstorable_text(name)}.", code="invalid_value")
        reason = unstorable_text(value)
        if reason:
            raise APIError(400, f"Invalid value for '{name}': it {reason}.", param=name, code="invalid_value")
    if request.method == "POST" and request.url.path == "/v1/messages/batches":
        return     # a create body streams to the store and is checked there (jobs/batches/anthropic_batches.py)
    if _is_json(request.headers.get("content-type")):
        try:
            body = await request.json()   # parsed once: FastAPI has read it already and kept it
        except ValueError:
            return                         # not JSON: the body's own validation answers
        found = unstorable_value(body, "")
        if found is not None:
            param, reason = found[0].lstrip("."), found[1]
            raise APIError(400, f"Invalid value for '{param or 'body'}': it {reason}.", param=param or None,
                           code="invalid_value")


def _cannot_be_an_id(value: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in value) or unstorable_text(value) is not None


def _is_json(content_type: Optional[str]) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _shaped_by_path(handler):  # noqa: ANN001, ANN202
    """The handler's answer, in Anthropic's envelope on Anthropic's paths (api/anthropic/errors.py)."""
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = await handler(request, exc)
        return reshape(response) if is_anthropic_path(request.url.path) else response
    return handle


def install_error_handlers(app: FastAPI) -> None:
    for kind, handler in ((APIError, _api_error), (NotFound, _not_found), (InvalidInput, _invalid_input),
                          (Conflict, _conflict), (RequestValidationError, _validation_error),
                          (StarletteHTTPException, _http_error), (Overloaded, _overloaded),
                          (DatabaseUnavailable, _database_unavailable), (PoolTimeout, _pool_timeout),
                          (DataError, _data_error), (Exception, _unexpected_error)):
        app.add_exception_handler(kind, _shaped_by_path(handler))

"""The error of one request body: raised by the checks, written as an error-file line (HTTP 400
with OpenAI's error body). ``param`` is the path of the field inside the body
(``logit_bias.50256``, ``tools.0.function.name``)."""
from __future__ import annotations

from typing import Any, Optional

from nightshift.jobs.errors import InvalidInput


class RequestBodyError(InvalidInput):
    """A request body the model cannot run (message, param, code); becomes a 400 line in the
    error file."""


def error_body(code: str, message: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}

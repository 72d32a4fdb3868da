"""Domain errors the API layer turns into OpenAI error answers (404 / 400 / 409)."""
from __future__ import annotations

from typing import Optional


class NotFound(LookupError):
    """No such object in this project (another project's object is "not found" too)."""

    def __init__(self, kind: str, object_id: str, param: Optional[str] = None):
        super().__init__(f"No {kind} found with id '{object_id}'.")
        self.kind = kind
        self.object_id = object_id
        self.param = param


class InvalidInput(ValueError):
    """A request the domain refuses; names the parameter and carries an OpenAI-style code."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Conflict(RuntimeError):
    """The object's state forbids the operation (e.g. cancelling a completed batch)."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.code = code

"""OpenAI-style ids: ``file-…``, ``batch_…``, ``proj_…``, ``key_…``."""
from __future__ import annotations

import hashlib
import secrets


def new_id(prefix: str) -> str:
    """``prefix`` + 24 random hex characters, e.g. ``new_id("batch_")``."""
    return prefix + secrets.token_hex(12)


def derived_id(prefix: str, *parts: str) -> str:
    """A deterministic id from ``parts`` (same inputs, same id): lets a retried step reuse its row."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]
    return prefix + digest


def batch_request_id(request_row_id: int) -> str:
    """The ``id`` of an output line (``batch_req_…``), stable across re-runs."""
    return f"batch_req_{request_row_id:016x}"


def response_request_id(request_row_id: int) -> str:
    return f"req_{request_row_id:016x}"


def message_id(request_row_id: int) -> str:
    """The ``id`` of an Anthropic Message answering a message batch's request (``msg_…``)."""
    return f"msg_{request_row_id:016x}"


def tool_call_id(request_row_id: int, choice: int, call: int) -> str:
    """The ``id`` of a tool call in a response (``call_…``), the same on every re-run."""
    return derived_id("call_", str(request_row_id), str(choice), str(call))

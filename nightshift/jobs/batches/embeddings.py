"""/v1/embeddings batch lines (openai_mapping.EMBEDDINGS), as plain data: what a body must
hold, its inputs, the planned size of a line, and the response body in OpenAI's shape (no
engine import here; the engine worker turns vectors into floats or base64 and calls
``response_body``).

A body is ``{"model", "input", "encoding_format"?, "dimensions"?, "user"?}``. ``input`` is a
string, an array of strings, an array of token ids, or an array of token-id arrays (OpenAI's
four forms), at most ``MAX_INPUTS`` entries, no empty string or array. What only the model
can judge (a token id outside its vocabulary, ``dimensions`` above its size) fails that line
alone at run time, as a 400 line in the error file.
"""
from __future__ import annotations

from typing import Any, Optional, Union
MAX_INPUTS = 2048               # OpenAI's limit on the entries of one request's input array
ENCODING_FORMATS = ("float", "base64")
# Planning estimate for a text: about 4 UTF-8 bytes a token, plus the special tokens, at most
# what any supported encoder reads (the engine truncates at the model's max_seq_length).
BYTES_PER_TOKEN = 4
SPECIAL_TOKENS = 2
MAX_PLANNED_TOKENS_PER_INPUT = 512

EmbeddingInput = Union[str, list[int]]


class EmbeddingBodyError(ValueError):
    def __init__(self, message: str, param: str, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_body(body: dict[str, Any]) -> None:
    """Raise EmbeddingBodyError (with the field's path under ``body``) for a body no model could
    run."""
    inputs(body)
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise EmbeddingBodyError(f"Invalid value: {fmt!r}. Supported values are: 'float' and 'base64'.",
                                 "body.encoding_format", "invalid_value")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                   or dimensions < 1):
        raise EmbeddingBodyError(f"'dimensions' must be a positive integer (got {dimensions!r}).", "body.dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise EmbeddingBodyError("'user' must be a string.", "body.user")


def inputs(body: dict[str, Any]) -> list[EmbeddingInput]:
    """The body's inputs as a list of texts and token arrays (one entry per output vector)."""
    value = body.get("input")
    if value is None:
        raise EmbeddingBodyError("Input parameter is required.", "body.input")
    if isinstance(value, str):
        if not value:
            raise EmbeddingBodyError("'input' cannot be an empty string.", "body.input")
        return [value]
    if not isinstance(value, list) or not value:
        raise EmbeddingBodyError("'input' must be a string, an array of strings, an array of token ids or an "
                                 "array of token-id arrays, and not empty.", "body.input")
    if len(value) > MAX_INPUTS:
        raise EmbeddingBodyError(f"'input' has {len(value)} entries; at most {MAX_INPUTS} are allowed.",
                                 "body.input")
    if isinstance(value[0], int) and not isinstance(value[0], bool):   # one token array
        for i, token in enumerate(value):
            if not _is_token(token):
                raise EmbeddingBodyError(f"A token array holds non-negative integers only (got {token!r}).",
                                         f"body.input.{i}")
        return [list(value)]
    kind = str if isinstance(value[0], str) else list
    for i, entry in enumerate(value):
        if kind is str and not isinstance(entry, str):
            raise EmbeddingBodyError("'input' mixes strings with other values: an array holds strings only, "
                                     "token ids only, or token-id arrays only.", f"body.input.{i}")
        if kind is str and not entry:
            raise EmbeddingBodyError("'input' cannot hold an empty string.", f"body.input.{i}")
        if kind is list and not (isinstance(entry, list) and entry and all(_is_token(t) for t in entry)):
            raise EmbeddingBodyError("Each token-id array must be a non-empty array of non-negative integers.",
                                     f"body.input.{i}")
    return [entry if kind is str else list(entry) for entry in value]


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def planned_tokens(body: dict[str, Any]) -> int:
    """Estimated tokens of a valid line (shard planning and the batch's token limit; the
    engine counts the real ones)."""
    total = 0
    for entry in inputs(body):
        size = len(entry) if isinstance(entry, list) else len(entry.encode("utf-8")) // BYTES_PER_TOKEN
        total += min(size + SPECIAL_TOKENS, MAX_PLANNED_TOKENS_PER_INPUT)
    return total


def encoding_format(body: dict[str, Any]) -> str:
    return body.get("encoding_format") or "float"


def dimensions(body: dict[str, Any]) -> Optional[int]:
    return body.get("dimensions")


def response_body(model: str, embeddings: list[Union[list[float], str]], prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: one entry per input, in input order; each embedding a list
    of floats or (encoding_format "base64") the base64 of its little-endian float32 bytes."""
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

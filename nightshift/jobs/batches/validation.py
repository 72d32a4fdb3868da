"""Streaming validation of a batch input file.

Every line is checked; each bad line gives one error entry ``{code, message, param, line}``
with OpenAI's codes, ``param`` the path of the field (``custom_id``, ``body.messages.2.role``).
Lines are numbered from 1; blank lines are skipped (but counted); a UTF-8 byte order mark
before the first line is skipped, as most JSONL readers do.
Everything stored from a line must be storable in any database: no NUL character (Postgres
text and JSON cannot hold one) in ``custom_id`` or anywhere in the body, no deeper nesting than
``MAX_BODY_DEPTH``, a ``custom_id`` within its column.
The body's other fields (sampling values, n, tools, response_format: request_fields.py) are not
judged here: a bad value fails only that request (an error-file line), not the batch. The lines
of an Anthropic message batch (endpoint /v1/messages, written by the API from the create body)
are checked here only for what every line needs (custom_id, storable values): their ``params``,
model included, are judged per request (anthropic_messages.py), as Anthropic does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import orjson

from nightshift.jobs.batches import embeddings
from nightshift.jobs.batches.openai_mapping import CHAT, EMBEDDINGS, MESSAGES
from nightshift.jobs.storable import MAX_JSON_DEPTH, unstorable_value

MAX_ERRORS = 1000  # entries kept on the batch object; the count of the rest is reported
MAX_CUSTOM_ID_CHARS = 512   # the requests.custom_id column
MAX_BODY_DEPTH = MAX_JSON_DEPTH   # nested arrays/objects in a body
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")   # OpenAI's roles
BOM = b"\xef\xbb\xbf"


@dataclass
class ValidLine:
    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class ValidationResult:
    lines: list[ValidLine] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    model: Optional[str] = None
    bytes_read: int = 0
    suppressed_errors: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def add_error(self, code: str, message: str, param: Optional[str] = None, line: Optional[int] = None) -> None:
        if len(self.errors) >= MAX_ERRORS:
            self.suppressed_errors += 1
            return
        # The entries are stored (a JSON column): a NUL quoted from the input must not come with them.
        self.errors.append({"code": code, "message": _storable(message), "param": _storable(param), "line": line})

    def errors_object(self) -> dict[str, Any]:
        data = list(self.errors)
        if self.suppressed_errors:
            data.append({"code": "too_many_errors", "param": None, "line": None,
                         "message": f"{self.suppressed_errors} more invalid lines not listed."})
        return {"object": "list", "data": data}


def _storable(text: Optional[str]) -> Optional[str]:
    return text.replace("\x00", "\\u0000") if text is not None and "\x00" in text else text


def _shown(text: str, limit: int = 40) -> str:
    """A piece of user input quoted in a message (short, NUL and control characters escaped)."""
    return repr(text[:limit] + ("…" if len(text) > limit else ""))


def _missing(name: str, line: int, result: ValidationResult) -> None:
    result.add_error("missing_required_parameter", f"Missing required parameter: '{name}'.", name, line)


def _check_body(body: dict[str, Any], endpoint: str, line: int, result: ValidationResult) -> bool:
    if endpoint == MESSAGES:
        return True
    if endpoint == EMBEDDINGS:
        return _check_embeddings_body(body, line, result)
    ok = True
    if body.get("stream"):
        kind = "Chat Completions" if endpoint == CHAT else "Completions"
        result.add_error("streaming_unsupported", f"{kind}: Streaming is not supported in the Batch API.",
                         "body.stream", line)
        ok = False
    if endpoint == CHAT:
        messages = body.get("messages")
        if messages is None:
            result.add_error("invalid_request", "Messages parameter is required.", "body.messages", line)
            ok = False
        elif not isinstance(messages, list) or not messages:
            result.add_error("invalid_request", "'messages' must be a non-empty array.", "body.messages", line)
            ok = False
        else:
            for i, msg in enumerate(messages):
                if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or \
                        ("content" not in msg and not _calls_without_content(msg)):
                    result.add_error("invalid_request", f"messages[{i}] must be an object with 'role' and 'content'.",
                                     f"body.messages.{i}", line)
                    ok = False
                    break
                if msg["role"] not in CHAT_ROLES:
                    result.add_error("invalid_value", f"Invalid value: {_shown(msg['role'])}. Supported values "
                                     "are: " + ", ".join(f"'{r}'" for r in CHAT_ROLES) + ".",
                                     f"body.messages.{i}.role", line)
                    ok = False
                    break
    else:
        prompt = body.get("prompt")
        if prompt is None:
            result.add_error("invalid_request", "Prompt parameter is required.", "body.prompt", line)
            ok = False
        elif not _is_prompt(prompt):
            result.add_error("invalid_request", "'prompt' must be a string, one string in an array, or an array "
                             "of token ids.", "body.prompt", line)
            ok = False
    return ok


def _calls_without_content(msg: dict[str, Any]) -> bool:
    """An assistant message that calls tools may leave its content out, as at OpenAI."""
    return msg.get("role") == "assistant" and (msg.get("tool_calls") is not None or msg.get("function_call") is not None)


def _check_embeddings_body(body: dict[str, Any], line: int, result: ValidationResult) -> bool:
    try:
        embeddings.check_body(body)
    except embeddings.EmbeddingBodyError as e:
        result.add_error(e.code, e.message, e.param, line)
        return False
    return True


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt)


def validate_lines(raw_lines: Iterable[bytes], endpoint: str, accepted_models: set[str], *,
                   max_lines: int, max_bytes: int) -> ValidationResult:
    """Validate the lines of one input file (an iterable of raw lines without newlines)."""
    result = ValidationResult()
    seen: dict[str, int] = {}
    n_requests = 0
    for number, raw in enumerate(raw_lines, start=1):
        result.bytes_read += len(raw) + 1
        if result.bytes_read > max_bytes + 1:
            result.add_error("file_too_large", f"The input file is larger than {max_bytes} bytes.", None, number)
            return result
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if not raw.strip():
            continue
        n_requests += 1
        if n_requests > max_lines:
            result.add_error("too_many_tasks", f"The input file has more than {max_lines} requests.", None, number)
            return result
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            result.add_error("invalid_json_line", f"This line is not valid UTF-8 (byte {e.start}).", None, number)
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            result.add_error("invalid_json_line", "This line is not parseable as valid JSON.", None, number)
            continue
        if not isinstance(obj, dict):
            result.add_error("invalid_json_line", "This line is not a JSON object.", None, number)
            continue
        line_ok = True
        custom_id = obj.get("custom_id")
        if custom_id is None:
            _missing("custom_id", number, result)
            line_ok = False
        elif not isinstance(custom_id, str) or not custom_id:
            result.add_error("invalid_request", "'custom_id' must be a non-empty string.", "custom_id", number)
            line_ok = False
        elif "\x00" in custom_id:
            result.add_error("invalid_request", "'custom_id' contains a NUL character (\\u0000), which cannot be "
                             "stored.", "custom_id", number)
            line_ok = False
        elif len(custom_id) > MAX_CUSTOM_ID_CHARS:
            result.add_error("invalid_request", f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters "
                             f"({len(custom_id)}).", "custom_id", number)
            line_ok = False
        elif custom_id in seen:
            result.add_error("duplicate_custom_id",
                             f"The custom_id for this request is a duplicate of another request (line "
                             f"{seen[custom_id]}). The custom_id parameter must be unique for each request "
                             "in a batch.", "custom_id", number)
            line_ok = False
        else:
            seen[custom_id] = number
        method = obj.get("method")
        if method is None:
            _missing("method", number, result)
            line_ok = False
        elif method != "POST":
            result.add_error("invalid_request", f"Only the POST method is supported (got {method!r}).", "method",
                             number)
            line_ok = False
        url = obj.get("url")
        if url is None:
            _missing("url", number, result)
            line_ok = False
        elif url != endpoint:
            result.add_error("invalid_url", "The URL provided for this request does not match the batch "
                             f"endpoint ({endpoint}).", "url", number)
            line_ok = False
        body = obj.get("body")
        if body is None:
            _missing("body", number, result)
            continue
        if not isinstance(body, dict):
            result.add_error("invalid_request", "'body' must be a JSON object.", "body", number)
            continue
        # A NUL can only arrive escaped, and deep nesting needs many brackets: most lines skip the walk.
        suspect = b"\\u0000" in raw or raw.count(b"{") + raw.count(b"[") > MAX_BODY_DEPTH
        unstorable = unstorable_value(body, "body") if suspect else None
        if unstorable is not None:
            param, reason = unstorable
            result.add_error("invalid_request", f"'{param}' {reason}.", param, number)
            continue
        model = body.get("model")
        if endpoint == MESSAGES:
            if result.model is None and isinstance(model, str) and model in accepted_models:
                result.model = model        # the batch's model; a request naming another errs on its own
        elif model is None:
            result.add_error("invalid_request", "Model parameter is required.", "body.model", number)
            line_ok = False
        elif not isinstance(model, str) or model not in accepted_models:
            result.add_error("model_not_found", f"The provided model {model!r} is not supported by the Batch API. "
                             f"Available: {', '.join(sorted(accepted_models))}.", "body.model", number)
            line_ok = False
        elif result.model is None:
            result.model = model
        elif model != result.model:
            result.add_error("invalid_request", f"All requests in a batch must use the same model: line "
                             f"{number} uses {model!r}, earlier lines use {result.model!r}.", "body.model", number)
            line_ok = False
        if not _check_body(body, endpoint, number, result):
            line_ok = False
        if line_ok:
            result.lines.append(ValidLine(number, custom_id, body))
    if n_requests == 0 and not result.errors:
        result.add_error("empty_file", "The input file contains no requests.", None, None)
    return result

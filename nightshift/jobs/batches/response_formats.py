"""``response_format`` -> the grammar the engine enforces, as plain data (the worker turns the
dict into ``engine.StructuredOutput``): ``{"kind", "spec", "param"}``, ``param`` the body field a
refusal of the grammar names.

- ``{"type": "text"}``: no grammar;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``: the
  schema. ``strict`` true or false, the output follows the schema exactly (a grammar cannot
  follow it loosely); a schema the grammar compiler cannot express comes back from the engine
  as an error naming ``response_format.json_schema.schema``.

JSON is written compact (no whitespace between tokens). On /v1/completions too, as vLLM
accepts it.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from nightshift.jobs.batches.request_errors import RequestBodyError

# OpenAI's rule for names of schemas and functions
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def check_name(value: Any, param: str) -> str:
    if value is None:
        raise RequestBodyError(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise RequestBodyError(f"Invalid '{param}': {value!r} does not match the pattern '^[a-zA-Z0-9_-]{{1,64}}$'.",
                               param, "invalid_value")
    return value


def check_known_keys(obj: dict[str, Any], allowed: tuple[str, ...], param: str) -> None:
    for key in obj:
        if key not in allowed:
            raise RequestBodyError(f"Unrecognized request argument supplied: {param}.{key}", f"{param}.{key}",
                                   "unknown_parameter")


def check_optional(obj: dict[str, Any], key: str, kind: type, param: str) -> None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise RequestBodyError(f"'{param}.{key}' must be a {'boolean' if kind is bool else 'string'}.",
                               f"{param}.{key}")


def check_schema_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestBodyError(f"'{param}' must be a JSON Schema object.", param)
    return value


def structured_output(body: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The grammar of the body's response_format; None for text (or none)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestBodyError("'response_format' must be an object with a 'type'.", "response_format")
    kind = fmt.get("type")
    if kind is None:
        raise RequestBodyError("Missing required parameter: 'response_format.type'.", "response_format.type",
                               "missing_required_parameter")
    if kind not in FORMAT_TYPES:
        raise RequestBodyError(f"Invalid value for 'response_format.type': {kind!r}. Supported values are: "
                               + ", ".join(f"'{t}'" for t in FORMAT_TYPES) + ".", "response_format.type",
                               "invalid_value")
    if kind != "json_schema":
        check_known_keys(fmt, ("type",), "response_format")
        return None if kind == "text" else {"kind": "json_object", "spec": None, "param": "response_format"}
    check_known_keys(fmt, ("type", "json_schema"), "response_format")
    spec = fmt.get("json_schema")
    if spec is None:
        raise RequestBodyError("Missing required parameter: 'response_format.json_schema'.",
                               "response_format.json_schema", "missing_required_parameter")
    if not isinstance(spec, dict):
        raise RequestBodyError("'response_format.json_schema' must be an object.", "response_format.json_schema")
    param = "response_format.json_schema"
    check_known_keys(spec, JSON_SCHEMA_KEYS, param)
    check_name(spec.get("name"), f"{param}.name")
    check_optional(spec, "description", str, param)
    check_optional(spec, "strict", bool, param)
    if spec.get("schema") is None:
        raise RequestBodyError(f"Missing required parameter: '{param}.schema'.", f"{param}.schema",
                               "missing_required_parameter")
    schema = check_schema_object(spec["schema"], f"{param}.schema")
    return {"kind": "json_schema", "spec": schema, "param": f"{param}.schema"}

"""Text and JSON no database can store: a NUL character (Postgres text and JSON cannot hold
one), a lone surrogate (not Unicode text), JSON nested deeper than ``MAX_JSON_DEPTH``.
Checked at every edge where user input is stored (the API's bodies, ids and query values,
upload names, batch input lines), so such input is refused with the field named instead of
failing in the database driver."""
from __future__ import annotations

from typing import Any, Optional

MAX_JSON_DEPTH = 64   # nested arrays/objects in a stored JSON value (the JSON encoder stops at 254)


def unstorable_text(text: str) -> Optional[str]:
    """Why no database can store this string, or None."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000), which cannot be stored"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode text)"
    return None


def shown_key(key: str) -> str:
    """A JSON key as it may appear in a param path (NUL and lone surrogates escaped)."""
    return key.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\u0000")


def unstorable_value(value: Any, path: str, depth: int = 0) -> Optional[tuple[str, str]]:
    """(param path, reason) of the first string or key in ``value`` (JSON data) that no
    database can store, or of nesting deeper than MAX_JSON_DEPTH; None when all is storable.
    Paths are dotted: ``body.messages.2.content``."""
    if isinstance(value, str):
        reason = unstorable_text(value)
        return (path, reason) if reason else None
    if isinstance(value, (dict, list)):
        if depth >= MAX_JSON_DEPTH:
            return path, f"is nested more than {MAX_JSON_DEPTH} levels deep"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and unstorable_text(key):
                return f"{path}.{shown_key(key)}", f"has a key that {unstorable_text(key)}"
            found = unstorable_value(item, f"{path}.{key}", depth + 1)
            if found is not None:
                return found
    return None

"""Incremental reindexing: pure rules (no database, no object store).

A scheduled run turns documents into batch requests. Only documents whose content hash
differs from the hash recorded at their last successful indexing are sent again; each
successful answer is written to `<index_prefix><document key>.json` (replacing the old one)
and the manifest `<index_prefix>_manifest.json` records, per document, which content was
indexed when and by which run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import orjson
from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import SandboxedEnvironment

MANIFEST_NAME = "_manifest.json"
_jinja = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False)


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Selection:
    changed: list[str]     # new or modified: to (re)process, sorted
    unchanged: list[str]   # same hash as last indexed, sorted
    removed: list[str]     # indexed before, gone from the source now, sorted


def select_changed(current: Mapping[str, str], indexed: Mapping[str, str]) -> Selection:
    """Compare the source's {key: hash} with the last indexed {key: hash}."""
    changed = sorted(k for k, h in current.items() if indexed.get(k) != h)
    unchanged = sorted(k for k, h in current.items() if indexed.get(k) == h)
    removed = sorted(k for k in indexed if k not in current)
    return Selection(changed, unchanged, removed)


class TemplateRenderError(ValueError):
    pass


def check_prompt_template(template: Any) -> None:
    """Compile every string of a request-body template; raise naming the bad one."""
    if not isinstance(template, dict):
        raise TemplateRenderError("prompt_template must be a JSON object (the request body)")
    for path, text in _strings(template, "prompt_template"):
        try:
            _jinja.from_string(text)
        except TemplateError as exc:
            raise TemplateRenderError(f"{path}: {exc}") from exc


def _strings(value: Any, path: str):
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")


def render_body(template: Any, *, document: str, key: str) -> Any:
    """Render every string in the template with `{{ document }}` and `{{ key }}`."""
    if isinstance(template, str):
        try:
            return _jinja.from_string(template).render(document=document, key=key)
        except TemplateError as exc:
            raise TemplateRenderError(f"document {key!r}: {exc}") from exc
    if isinstance(template, dict):
        return {k: render_body(v, document=document, key=key) for k, v in template.items()}
    if isinstance(template, list):
        return [render_body(v, document=document, key=key) for v in template]
    return template


def request_line(*, custom_id: str, endpoint: str, body: dict, model: Optional[str]) -> bytes:
    """One batch input JSONL line for a document."""
    if model and "model" not in body:
        body = {**body, "model": model}
    line = {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}
    return orjson.dumps(line) + b"\n"


def normalize_prefix(prefix: str) -> str:
    prefix = prefix.strip().lstrip("/")
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


def output_key(index_prefix: str, document_key: str) -> str:
    return f"{normalize_prefix(index_prefix)}{document_key}.json"


def manifest_key(index_prefix: str) -> str:
    return f"{normalize_prefix(index_prefix)}{MANIFEST_NAME}"


def output_document(*, document_key: str, sha256: str, run_id: str, batch_id: str,
                    indexed_at: int, response_body: Any) -> bytes:
    """The stored result for one document: the model's answer plus where it came from."""
    return orjson.dumps({
        "document": document_key, "sha256": sha256, "run_id": run_id,
        "batch_id": batch_id, "indexed_at": indexed_at, "response": response_body,
    }, option=orjson.OPT_INDENT_2)


def build_manifest(*, schedule_id: str, index_prefix: str, updated_at: int,
                   last_run: dict, documents: Mapping[str, dict], index_file: Optional[str] = None) -> bytes:
    """The manifest: per document {sha256, output_key, indexed_at, run_id, batch_id}; for an
    embeddings schedule also ``index_file``, the newest vector index."""
    manifest = {
        "object": "index.manifest",
        "schedule_id": schedule_id,
        "index_prefix": normalize_prefix(index_prefix),
        "updated_at": updated_at,
        "last_run": last_run,
        "document_count": len(documents),
    }
    if index_file is not None:
        manifest["index_file"] = index_file
    manifest["documents"] = {k: documents[k] for k in sorted(documents)}
    return orjson.dumps(manifest, option=orjson.OPT_INDENT_2)

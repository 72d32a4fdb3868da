"""The vector index of an embeddings reindex schedule.

Each run of a schedule whose endpoint is ``/v1/embeddings`` writes, besides the per-document
outputs, one index file ``<index_prefix>_index/<run id>.jsonl``: one line per document the
index holds after the run, sorted by key, ``{"key", "sha256", "vector"}`` (``"vectors"`` when a
document's request embedded several inputs). Vectors of documents this run did not re-embed
are carried over from the previous run's index file (named by the manifest's ``index_file``),
or, where that lacks them, read from the document's output; documents deleted from the source
are left out. The manifest names the newest index file.
"""
from __future__ import annotations

import base64
import struct
from typing import Any, Iterable, Mapping, Optional

import orjson

from nightshift.jobs.batches.openai_mapping import EMBEDDINGS  # noqa: F401 - the endpoint this index is for
from nightshift.jobs.schedules.reindex import normalize_prefix
from nightshift.storage.objectstore import ObjectStore, iter_lines



def index_file_key(index_prefix: str, run_id: str) -> str:
    return f"{normalize_prefix(index_prefix)}_index/{run_id}.jsonl"


def vectors_of(response_body: Any) -> Optional[list[list[float]]]:
    """The vectors of an embeddings response body (float lists; base64 answers decoded), in
    input order; None if the body is not one."""
    if not isinstance(response_body, dict) or not isinstance(response_body.get("data"), list):
        return None
    vectors = []
    for item in sorted(response_body["data"], key=lambda d: d.get("index", 0)):
        embedding = item.get("embedding") if isinstance(item, dict) else None
        if isinstance(embedding, str):
            raw = base64.b64decode(embedding)
            embedding = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        if not isinstance(embedding, list):
            return None
        vectors.append(embedding)
    return vectors


def index_entry(key: str, sha256: str, vectors: list[list[float]]) -> dict[str, Any]:
    entry: dict[str, Any] = {"key": key, "sha256": sha256}
    if len(vectors) == 1:
        entry["vector"] = vectors[0]
    else:
        entry["vectors"] = vectors
    return entry


def read_index(store: ObjectStore, key: Optional[str]) -> dict[str, dict[str, Any]]:
    """The entries of an index file by document key ({} when there is none, or it is gone)."""
    if not key or not store.exists(key):
        return {}
    entries = {}
    for raw in iter_lines(store.get_stream(key)):
        if raw.strip():
            entry = orjson.loads(raw)
            entries[entry["key"]] = entry
    return entries


def previous_index_file(store: ObjectStore, manifest_key: str) -> Optional[str]:
    if not store.exists(manifest_key):
        return None
    try:
        return orjson.loads(b"".join(store.get_stream(manifest_key))).get("index_file")
    except (orjson.JSONDecodeError, AttributeError):
        return None


def write_index(store: ObjectStore, key: str, documents: Mapping[str, Mapping[str, Any]],
                fresh: Mapping[str, dict[str, Any]], previous: Mapping[str, dict[str, Any]]) -> int:
    """Write the index of ``documents`` ({key: {"sha256", "output_key", ...}}, what the schedule
    holds after this run): this run's ``fresh`` entries, else the previous index's entry of the
    same content, else the vectors in the document's stored output. Returns the entry count."""
    def lines() -> Iterable[bytes]:
        for doc_key in sorted(documents):
            doc = documents[doc_key]
            entry = fresh.get(doc_key)
            if entry is None:
                old = previous.get(doc_key)
                entry = old if old is not None and old.get("sha256") == doc["sha256"] else \
                    _entry_from_output(store, doc_key, doc)
            if entry is not None:
                yield orjson.dumps(entry) + b"\n"

    counted = _Counted(lines())
    store.put_stream(key, counted)
    return counted.n


def _entry_from_output(store: ObjectStore, doc_key: str, doc: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    try:
        output = orjson.loads(b"".join(store.get_stream(doc["output_key"])))
    except (KeyError, FileNotFoundError, orjson.JSONDecodeError):
        return None
    vectors = vectors_of(output.get("response"))
    return index_entry(doc_key, doc["sha256"], vectors) if vectors else None


class _Counted:
    """Iterates the lines, counting them."""

    def __init__(self, lines: Iterable[bytes]):
        self._lines, self.n = iter(lines), 0

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        line = next(self._lines)
        self.n += 1
        return line

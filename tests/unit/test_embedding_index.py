"""The vector index of an embeddings schedule: vectors read from responses (float or base64),
entries carried over from the previous index only for unchanged content, deleted documents
left out, and a document missing from the previous index recovered from its stored output."""
from __future__ import annotations

import base64
import struct

import orjson

from nightshift.jobs.schedules.embedding_index import (index_entry, index_file_key, previous_index_file, read_index,
                                                       vectors_of, write_index)
from nightshift.jobs.schedules.reindex import build_manifest, output_document
from nightshift.storage.localdir import LocalDirStore


def response(*vectors: list[float], b64: bool = False) -> dict:
    def encode(v):  # noqa: ANN001, ANN202
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if b64 else v
    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": list(reversed(data)), "model": "m", "usage": {"prompt_tokens": 1, "total_tokens": 1}}


def test_vectors_in_input_order_from_float_and_base64_answers():
    assert vectors_of(response([0.5, 1.0], [2.0, -1.0])) == [[0.5, 1.0], [2.0, -1.0]]
    assert vectors_of(response([0.25, -0.75], b64=True)) == [[0.25, -0.75]]
    assert vectors_of({"error": {"code": "x"}}) is None and vectors_of(None) is None


def test_index_carries_unchanged_entries_drops_deleted_and_recovers_from_outputs(tmp_path):
    store = LocalDirStore(tmp_path)
    first = index_file_key("idx/", "run_1")
    documents = {"a.txt": {"sha256": "ha", "output_key": "idx/a.txt.json"},
                 "b.txt": {"sha256": "hb", "output_key": "idx/b.txt.json"},
                 "c.txt": {"sha256": "hc", "output_key": "idx/c.txt.json"}}
    fresh = {k: index_entry(k, d["sha256"], [[float(i)]]) for i, (k, d) in enumerate(documents.items())}
    assert write_index(store, first, documents, fresh, {}) == 3
    store.put_stream("idx/_manifest.json", build_manifest(schedule_id="s", index_prefix="idx/", updated_at=1,
                                                         last_run={}, documents=documents, index_file=first))
    assert previous_index_file(store, "idx/_manifest.json") == first

    # run 2: b edited, c deleted, d added; a unchanged (carried over)
    store.put_stream("idx/d.txt.json", output_document(document_key="d.txt", sha256="hd", run_id="run_0",
                                                       batch_id="b", indexed_at=1, response_body=response([9.0])))
    documents2 = {"a.txt": documents["a.txt"], "b.txt": {"sha256": "hb2", "output_key": "idx/b.txt.json"},
                  "d.txt": {"sha256": "hd", "output_key": "idx/d.txt.json"}}
    second = index_file_key("idx/", "run_2")
    n = write_index(store, second, documents2, {"b.txt": index_entry("b.txt", "hb2", [[7.0], [8.0]])},
                    read_index(store, first))
    entries = [orjson.loads(x) for x in b"".join(store.get_stream(second)).splitlines()]
    assert n == 3 and entries == [{"key": "a.txt", "sha256": "ha", "vector": [0.0]},
                                  {"key": "b.txt", "sha256": "hb2", "vectors": [[7.0], [8.0]]},
                                  {"key": "d.txt", "sha256": "hd", "vector": [9.0]}]
    assert read_index(store, first)["c.txt"]["vector"] == [2.0]      # the earlier run's file is kept

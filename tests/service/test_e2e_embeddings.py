"""/v1/embeddings batches end to end, production shape: the HTTP API (uvicorn), a cpu worker
with beat and a gpu worker (real Celery on real Redis), Postgres, moto's S3 server and the real
default embedding model, driven only through the official openai client."""
from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest

from .api_fixtures import production_pipeline

REDIS_DB = 11   # apart from the other service tests' Redis databases
TEXTS = ["Nightshift embeds batches overnight.", "Москва — столица России. 東京都の天気は晴れです 🎉",
         "A long paragraph about rivers and bridges. " * 60]


@pytest.fixture
def pipeline(pg_url, s3_server, tmp_path):
    with production_pipeline(pg_url, s3_server, tmp_path, REDIS_DB, "e2e-emb") as running:
        yield running


def embedding_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "all-MiniLM-L6-v2", **body}}


@pytest.mark.slow
def test_openai_client_embeddings_batch(pipeline):
    from nightshift.engine.embeddings import EmbeddingEngine

    service, client = pipeline
    lines = [embedding_line("single", input=TEXTS[0]),
             embedding_line("several", input=TEXTS, encoding_format="base64"),
             embedding_line("short", input=TEXTS[1], dimensions=128),
             embedding_line("too-wide", input=TEXTS[0], dimensions=4096)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    input_file = client.files.create(file=("embeddings.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h")
    assert batch.status == "validating" and batch.endpoint == "/v1/embeddings"

    deadline = time.time() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, f"batch stuck in {batch.status}:\n{service.logs()}"
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch.errors, service.log("worker-gpu"))
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens == 0

    output = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert list(output) == ["single", "several", "short"]                  # input order

    def vectors(custom_id: str) -> np.ndarray:
        response = output[custom_id]["response"]
        body = response["body"]
        assert response["status_code"] == 200 and output[custom_id]["error"] is None
        assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(len(body["data"]))]
        return np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
                         else d["embedding"] for d in body["data"]], dtype=np.float32)

    engine = EmbeddingEngine.from_pretrained("default", device="cpu")
    single, several, short = vectors("single"), vectors("several"), vectors("short")
    assert single.shape == (1, 384) and several.shape == (3, 384) and short.shape == (1, 128)
    for got in (single, several, short):
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    expected = engine.embed(TEXTS)
    for got, want in ((single[0], expected[0]), *zip(several, expected)):
        assert float(got @ want) >= 0.999
    head = expected[1][:128] / np.linalg.norm(expected[1][:128])
    assert float(short[0] @ head) >= 0.999

    (refused,) = errors
    assert refused["custom_id"] == "too-wide" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "dimensions"

    cost = client.get(f"/batches/{batch.id}/cost", cast_to=object)
    assert cost["tokens"]["prompt_tokens"] == batch.usage.input_tokens
    assert cost["requests"] == {"total": 4, "completed": 3, "failed": 1}

"""/v1/embeddings batches in-process with the real embedding model: ingest -> the embeddings
shard stream -> finalize; OpenAI's response shape, float and base64, token-array inputs,
`dimensions`, failures isolated per line, usage and cost rows, and shards of the other engine
never taken ahead."""
from __future__ import annotations

import base64

import numpy as np
import pytest
from sqlalchemy import select

from nightshift.jobs.batches.leases import claim_next_shard
from nightshift.jobs.batches.models import Batch, Request, Shard
from nightshift.jobs.batches.openai_mapping import CHAT, COMPLETIONS, EMBEDDINGS
from nightshift.jobs.costs.batch_costs import live_cost_report
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from tests.service.factories import (make_batch, make_input_file, make_project, make_running_batch, read_result_lines,
                                     run_batch_in_process)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "東京都の天気は晴れです", "naïve café " * 200]


@pytest.fixture(scope="module")
def engine():
    from nightshift.engine.embeddings import EmbeddingEngine

    return EmbeddingEngine.from_pretrained("default", device="cpu")


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS, "body": {"model": "default", **body}}


def no_chat_tokenizer() -> None:
    raise AssertionError("ingest loaded the chat model's tokenizer for an embeddings batch")


def run_batch(db_url, store, settings, engine, lines):  # noqa: ANN001
    from nightshift.workers.embedding_stream import run_embedding_shard

    # embeddings lines are tokenized by the engine worker: ingest does not load the chat tokenizer
    return run_batch_in_process(db_url, store, settings, lines, endpoint=EMBEDDINGS, load_tokenizer=no_chat_tokenizer,
                                run_one=lambda sid: run_embedding_shard(sid, engine, settings=settings,
                                                                        owner="test-worker", device="cpu"))


def test_embeddings_batch_end_to_end_in_process(any_db, settings_env, tmp_path, engine):
    from nightshift.storage.objectstore import get_object_store

    # small shards so the batch spans several and one stream takes the rest after its own
    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", shard_max_requests=2,
                            shard_min_count=1, shard_min_requests=1)
    store = get_object_store()
    hello = engine.tokenizer.backend.encode("hello world", add_special_tokens=False).ids
    lines = [line("one", input=TEXTS[0]),
             line("many", input=TEXTS, encoding_format="base64"),
             line("tokens", input=hello),
             line("token-lists", input=[hello, hello[:1]]),
             line("dims", input=TEXTS[0], dimensions=64),
             line("too-many-dims", input="x", dimensions=1000),
             line("bad-token", input=[[1, 10**7]])]
    bid, shard_ids = run_batch(any_db, store, settings, engine, lines)
    assert len(shard_ids) == 4
    result = finalize_batch(bid, settings=settings, store=store)
    assert (result.status, result.output_lines, result.error_lines) == ("completed", 5, 2)
    with session_scope(any_db) as s:
        batch = s.get(Batch, bid)
        rows = {r.custom_id: r for r in s.scalars(select(Request).where(Request.batch_id == bid))}
        report = live_cost_report(s, batch, settings)
    out = {o["custom_id"]: o["response"] for o in read_result_lines(store, any_db, batch.output_file_id)}
    errors = {e["custom_id"]: e["response"] for e in read_result_lines(store, any_db, batch.error_file_id)}

    def vectors(body):  # noqa: ANN001, ANN202
        assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])
        return np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
                         else d["embedding"] for d in body["data"]], dtype=np.float32)

    assert set(out) == {"one", "many", "tokens", "token-lists", "dims"}
    for custom_id, response in out.items():
        assert response["status_code"] == 200
        usage = response["body"]["usage"]
        assert usage == {"prompt_tokens": rows[custom_id].prompt_tokens, "total_tokens": rows[custom_id].prompt_tokens}
        assert usage["prompt_tokens"] > 0 and rows[custom_id].engine_seconds > 0
    np.testing.assert_allclose(vectors(out["one"]["body"]), engine.embed(TEXTS[:1]), atol=1e-5)
    assert isinstance(out["many"]["body"]["data"][0]["embedding"], str)      # base64
    np.testing.assert_allclose(vectors(out["many"]["body"]), engine.embed(TEXTS), atol=1e-5)
    assert out["many"]["body"]["usage"]["prompt_tokens"] == sum(len(ids) for ids, _ in engine.tokenizer.encode_texts(TEXTS))
    np.testing.assert_allclose(vectors(out["tokens"]["body"]), engine.embed(["hello world"]), atol=1e-5)
    assert vectors(out["token-lists"]["body"]).shape == (2, 384)
    dims = vectors(out["dims"]["body"])
    assert dims.shape == (1, 64) and abs(np.linalg.norm(dims) - 1) < 1e-5
    assert errors["too-many-dims"]["status_code"] == 400
    assert errors["too-many-dims"]["body"]["error"]["param"] == "dimensions"
    assert "from 1 to 384" in errors["too-many-dims"]["body"]["error"]["message"]
    assert errors["bad-token"]["body"]["error"]["code"] == "invalid_token"
    # cost rows count the embedding input tokens, priced against the online embedding price
    answered = sum(r.prompt_tokens for r in rows.values() if r.status == "completed")
    assert report["tokens"]["prompt_tokens"] == answered and report["tokens"]["completion_tokens"] == 0
    assert report["savings"]["online_list_usd"] == pytest.approx(answered * settings.online_embedding_usd_per_1m / 1e6)
    assert report["engine_seconds"] > 0


def test_streams_take_ahead_only_shards_their_engine_runs(any_db, settings_env, tmp_path, engine):
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.embedding_stream import run_embedding_shard

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", claim_ahead_after_seconds=0)
    store = get_object_store()
    _, chat_shards = make_running_batch(any_db, store, n_requests=2, n_shards=1)
    pid = make_project(any_db)
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, [line("a", input="hi")]), endpoint=EMBEDDINGS)
    (embedding_shard,) = ingest_batch(bid, settings=settings, store=store, load_tokenizer=no_chat_tokenizer).shard_ids
    with session_scope(any_db) as s:   # a chat stream looking for work ahead skips the embeddings shard
        assert claim_next_shard(s, "chat-worker", 30, waiting_since=2e9, endpoints=(CHAT, COMPLETIONS)).shard_id \
            == chat_shards[0]
    with session_scope(any_db) as s:
        s.get(Shard, chat_shards[0]).status, s.get(Shard, chat_shards[0]).lease_token = "pending", None
    run = run_embedding_shard(embedding_shard, engine, settings=settings, owner="w", device="cpu")
    assert run.status == "done" and run.shards_done == [embedding_shard]
    with session_scope(any_db) as s:
        assert s.get(Shard, chat_shards[0]).status == "pending"          # not taken by the embeddings stream
        assert claim_next_shard(s, "chat-worker", 30, waiting_since=2e9, endpoints=(EMBEDDINGS,)) is None
    again = run_embedding_shard(embedding_shard, engine, settings=settings, owner="other", device="cpu")
    assert again.status == "skipped"                                     # done: nothing runs or is written twice
    with session_scope(any_db) as s:
        assert {r.worker for r in s.scalars(select(Request).where(Request.batch_id == bid))} == {"w"}

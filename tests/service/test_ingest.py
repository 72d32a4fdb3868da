"""Ingest with the real tokenizer: validation outcome, COPY/executemany insert, shard plan, idempotence."""
from __future__ import annotations

import pytest
from sqlalchemy import func, select

from nightshift.jobs.batches.models import Batch, Request, Shard
from nightshift.storage.db import session_scope
from nightshift.workers.ingest import ingest_batch
from tests.service.factories import make_batch, make_input_file, make_project

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="session")
def tokenizer():
    from nightshift.engine import load_tokenizer

    return load_tokenizer("default")


def chat_line(i: int, system: str = "You are a terse assistant.", model: str = "default") -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": CHAT,
            "body": {"model": model, "max_tokens": 8,
                     "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}]}}


def test_valid_file_becomes_requests_and_prefix_grouped_shards(any_db, settings_env, tmp_path, tokenizer):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", shard_token_budget=400)
    store = get_object_store()
    pid = make_project(any_db)
    systems = ["You answer in French. " * 4, "You answer in German. " * 4]
    lines = [chat_line(i, systems[i % 2]) for i in range(20)]
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, lines))
    outcome = ingest_batch(bid, tokenizer, settings=settings, store=store)
    assert outcome.status == "in_progress" and outcome.request_count == 20 and len(outcome.shard_ids) >= 2
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert (b.status, b.request_total, b.model) == ("in_progress", 20, "default")
        rows = s.scalars(select(Request).where(Request.batch_id == bid).order_by(Request.line)).all()
        assert [r.line for r in rows] == list(range(1, 21)) and rows[3].custom_id == "r3"
        expected = tokenizer.apply_chat_template(lines[3]["body"]["messages"], add_generation_prompt=True)
        assert rows[3].prompt_token_ids == expected and rows[3].prompt_tokens == len(expected)
        assert rows[3].max_tokens == 8 and rows[3].body == lines[3]["body"] and rows[3].queued_at
        shards = s.scalars(select(Shard).where(Shard.batch_id == bid)).all()
        for sh in shards:
            members = [r for r in rows if r.shard_id == sh.id]
            assert len(members) == sh.num_requests and sh.planned_tokens <= 400
            assert len({r.body["messages"][0]["content"] for r in members}) == 1  # one system prompt per shard
        assert sum(sh.num_requests for sh in shards) == 20
    # a duplicated ingest message changes nothing
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).shard_ids == []
    with session_scope(any_db) as s:
        assert s.scalar(select(func.count()).select_from(Request).where(Request.batch_id == bid)) == 20


def test_invalid_file_fails_batch_with_line_errors(any_db, settings_env, tmp_path, tokenizer):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    pid = make_project(any_db)
    lines = [chat_line(0), b"{broken", chat_line(0), chat_line(3, model="gpt-4o")]
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, lines))
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).status == "failed"
    with session_scope(any_db) as s:
        b = s.get(Batch, bid)
        assert b.failed_at and b.errors["object"] == "list"
        assert [(e["line"], e["code"]) for e in b.errors["data"]] == [
            (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "model_not_found")]
        assert s.scalar(select(func.count()).select_from(Request).where(Request.batch_id == bid)) == 0


def test_over_limit_and_missing_file(any_db, settings_env, tmp_path, tokenizer):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o", max_lines=2)
    store = get_object_store()
    pid = make_project(any_db)
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, [chat_line(i) for i in range(3)]))
    ingest_batch(bid, tokenizer, settings=settings, store=store)
    fid = make_input_file(any_db, store, pid, [chat_line(0)])
    bid2 = make_batch(any_db, pid, fid)
    with session_scope(any_db) as s:
        store.delete(f"files/{fid}")
    ingest_batch(bid2, tokenizer, settings=settings, store=store)
    with session_scope(any_db) as s:
        assert s.get(Batch, bid).errors["data"][0]["code"] == "too_many_tasks"
        assert s.get(Batch, bid2).errors["data"][0]["param"] == "input_file_id"


def test_ingest_from_s3_into_postgres(pg_db, settings_env, s3_server, s3_bucket, tokenizer):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, object_store="s3", s3_bucket=s3_bucket, s3_endpoint_url=s3_server,
                            s3_access_key_id="t", s3_secret_access_key="t")
    store = get_object_store()
    pid = make_project(pg_db)
    bid = make_batch(pg_db, pid, make_input_file(pg_db, store, pid, [chat_line(i) for i in range(50)]))
    outcome = ingest_batch(bid, tokenizer, settings=settings, store=store)
    assert outcome.status == "in_progress" and outcome.request_count == 50


def test_cancelled_while_validating_is_not_ingested(any_db, settings_env, tmp_path, tokenizer):
    from nightshift.jobs.batches.lifecycle import request_cancel
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    pid = make_project(any_db)
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, [chat_line(0)]))
    with session_scope(any_db) as s:
        request_cancel(s, bid)
    assert ingest_batch(bid, tokenizer, settings=settings, store=store).status == "cancelling"


def test_completions_file_is_ingested(any_db, settings_env, tmp_path, tokenizer):
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    pid = make_project(any_db)
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": f"Once upon a time {i}", "max_tokens": 4}} for i in range(3)]
    bid = make_batch(any_db, pid, make_input_file(any_db, store, pid, lines), endpoint="/v1/completions")
    outcome = ingest_batch(bid, tokenizer, settings=settings, store=store)
    assert outcome.status == "in_progress" and outcome.request_count == 3
    with session_scope(any_db) as s:
        row = s.scalars(select(Request).where(Request.batch_id == bid, Request.custom_id == "p1")).one()
        assert row.prompt_token_ids == tokenizer.encode("Once upon a time 1")

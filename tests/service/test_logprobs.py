"""Logprobs through the real engine and shard stream: each generated token's logprob with its
text (decoded by the model's tokenizer), and the alternatives asked for, in OpenAI's chat and
completions shapes."""
from __future__ import annotations

import orjson
import pytest

from nightshift.jobs.batches.models import Batch
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch
from nightshift.workers.ingest import ingest_batch
from nightshift.workers.shard_stream import run_shard
from tests.service.factories import make_batch, make_input_file, make_project, read_result_lines
from tests.service.test_pipeline import CHAT, engine, line  # noqa: F401  (the session's engine)

pytestmark = pytest.mark.slow


def outputs(db_url, store, settings, engine, lines, endpoint=CHAT):  # noqa: ANN001, ANN201, F811
    """The response bodies of a batch run through ingest, the shard stream and finalize, by custom_id."""
    pid = make_project(db_url)
    bid = make_batch(db_url, pid, make_input_file(db_url, store, pid, lines), endpoint=endpoint)
    for shard_id in ingest_batch(bid, engine.tokenizer, settings=settings, store=store).shard_ids:
        run_shard(shard_id, engine, settings=settings, owner="w", device="cpu")
    assert finalize_batch(bid, settings=settings, store=store).status == "completed"
    with session_scope(db_url) as s:
        b = s.get(Batch, bid)
        out = read_result_lines(store, db_url, b.output_file_id)
        errors = read_result_lines(store, db_url, b.error_file_id) if b.error_file_id else []
    return {o["custom_id"]: o["response"]["body"] for o in out + errors}


def test_chat_logprobs_carry_each_token_text(pg_db, settings_env, tmp_path, engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    bodies = outputs(pg_db, store, settings, engine, [
        line(0, logprobs=True, ignore_eos=True), line(1), line(2, logprobs=True, top_logprobs=2)])
    chat = bodies["c0"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == bodies["c0"]["usage"]["completion_tokens"] == 4
    assert "".join(c["token"] for c in content) == chat["message"]["content"]
    for c in content:
        assert c["logprob"] <= 0 and c["top_logprobs"] == []
        assert "\ufffd" in c["token"] or c["bytes"] == list(c["token"].encode())
    assert bytes(b for c in content for b in c["bytes"]).decode() == chat["message"]["content"]
    assert bodies["c1"]["choices"][0]["logprobs"] is None                     # not asked for
    # alternatives: two per position, best first; greedy (temperature 0), the chosen token is the best one
    content = bodies["c2"]["choices"][0]["logprobs"]["content"]
    assert content and len(content) == bodies["c2"]["usage"]["completion_tokens"]
    for c in content:
        top = c["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert (top[0]["token"], top[0]["bytes"]) == (c["token"], c["bytes"])
        assert top[0]["logprob"] == pytest.approx(c["logprob"], abs=1e-4)


def test_completion_logprobs_carry_tokens_and_offsets(pg_db, settings_env, tmp_path, engine):  # noqa: F811
    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    lines = [{"custom_id": "p0", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": "The sky is", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True, "logprobs": 0}}]
    choice = outputs(pg_db, store, settings, engine, lines, "/v1/completions")["p0"]["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4 and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    assert orjson.loads(orjson.dumps(lp))["top_logprobs"] is None


def test_completion_alternatives_are_one_object_per_position(pg_db, settings_env, tmp_path, engine):  # noqa: F811
    from openai.types import Completion

    from nightshift.storage.objectstore import get_object_store

    settings = settings_env(database_url=pg_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    lines = [{"custom_id": "p0", "method": "POST", "url": "/v1/completions",
              "body": {"model": "default", "prompt": "The sky is", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True, "logprobs": 3}}]
    body = outputs(pg_db, store, settings, engine, lines, "/v1/completions")["p0"]
    lp = Completion.model_validate(body).choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3                       # two ids may share a text
        # greedy: the chosen token has the best logprob. Two tokens can tie exactly (on the bf16
        # CPU math the LM head's logits are bf16 values, 1/8 apart near 25, as in HF's bf16), and
        # then either may be listed first
        best = max(top.values())
        assert token in top and top[token] == best == pytest.approx(logprob, abs=1e-4)

"""Object store backends (local folder and S3 through moto's HTTP server) and migrations."""
from __future__ import annotations

import os

import pytest
import sqlalchemy as sa

from nightshift.storage.objectstore import iter_lines


def _stores(kind, tmp_path, settings_env, s3_server=None, s3_bucket=None):
    from nightshift.storage.objectstore import get_object_store

    if kind == "local":
        return get_object_store(settings_env(storage_dir=tmp_path / "objects"))
    return get_object_store(settings_env(object_store="s3", s3_bucket=s3_bucket, s3_endpoint_url=s3_server,
                                         s3_access_key_id="test", s3_secret_access_key="test",
                                         s3_multipart_chunk_bytes=5 * 1024 * 1024))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, settings_env):
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        return _stores("s3", tmp_path, settings_env, server, bucket)
    return _stores("local", tmp_path, settings_env)


def test_put_get_delete_roundtrip(store):
    assert not store.exists("a/b.jsonl")
    assert store.put_stream("a/b.jsonl", b'{"x": 1}\n{"x": 2}\n') == 18
    assert store.exists("a/b.jsonl") and store.size("a/b.jsonl") == 18
    assert b"".join(store.get_stream("a/b.jsonl")) == b'{"x": 1}\n{"x": 2}\n'
    store.put_stream("a/b.jsonl", iter([b"new"]))  # a rewrite replaces
    assert b"".join(store.get_stream("a/b.jsonl")) == b"new"
    store.delete("a/b.jsonl")
    store.delete("a/b.jsonl")  # absent is fine
    assert not store.exists("a/b.jsonl")
    with pytest.raises(KeyError):
        list(store.get_stream("a/b.jsonl"))


def test_large_stream_is_multipart_and_exact(store):
    """12 MiB from a generator of 1 MiB chunks: S3 gets a 3-part multipart upload (5 MiB parts)."""
    chunk = os.urandom(1024 * 1024)
    n = store.put_stream("big/blob", (chunk for _ in range(12)))
    assert n == 12 * 1024 * 1024
    got = bytearray()
    for part in store.get_stream("big/blob", chunk_size=256 * 1024):
        assert len(part) <= 256 * 1024
        got += part
    assert bytes(got) == chunk * 12
    if hasattr(store, "client"):
        etag = store.client.head_object(Bucket=store.bucket, Key=store._key("big/blob"))["ETag"]
        assert etag.strip('"').endswith("-3")


def test_local_store_rejects_escaping_keys(tmp_path, settings_env):
    store = _stores("local", tmp_path, settings_env)
    with pytest.raises(ValueError):
        store.put_stream("../outside", b"x")


def test_iter_lines_across_chunks():
    assert list(iter_lines([b"ab", b"c\nde", b"\n", b"f"])) == [b"abc", b"de", b"f"]
    assert list(iter_lines([b"a\n\nb\n"])) == [b"a", b"", b"b"]


def test_migrations_create_all_tables(any_db):
    from nightshift.storage.db import get_engine

    names = set(sa.inspect(get_engine(any_db)).get_table_names())
    assert {"projects", "api_keys", "files", "batches", "shards", "requests", "alembic_version"} <= names
    cols = {c["name"] for c in sa.inspect(get_engine(any_db)).get_columns("requests")}
    assert {"prompt_tokens", "cached_tokens", "completion_tokens", "engine_seconds", "worker", "device",
            "queued_at", "started_at", "finished_at", "shard_id"} <= cols


def test_migration_downgrade_roundtrip(tmp_path):
    from alembic import command

    from nightshift.migrations import alembic_config, upgrade_head
    from nightshift.storage.db import get_engine

    url = f"sqlite:///{tmp_path / 'rt.db'}"
    upgrade_head(url)
    command.downgrade(alembic_config(url), "base")
    assert set(sa.inspect(get_engine(url)).get_table_names()) <= {"alembic_version"}
    upgrade_head(url)
    assert "requests" in sa.inspect(get_engine(url)).get_table_names()


def test_a_missing_bucket_is_created_or_refused_clearly(s3_server, settings_env):
    import uuid

    import boto3
    import pytest

    from nightshift.storage.objectstore import get_object_store, reset_object_store_cache

    name = f"nightshift-new-{uuid.uuid4().hex[:10]}"
    conf = dict(object_store="s3", s3_bucket=name, s3_endpoint_url=s3_server, s3_access_key_id="t",
                s3_secret_access_key="t", s3_addressing_style="path")
    settings_env(s3_create_bucket="false", **conf)
    with pytest.raises(RuntimeError, match=f"S3 bucket '{name}' does not exist: create it, or set "
                                           "NIGHTSHIFT_S3_CREATE_BUCKET=true"):
        get_object_store()
    reset_object_store_cache()
    settings_env(s3_create_bucket="true", **conf)
    store = get_object_store()
    store.put_stream("k", b"v")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="t",
                          aws_secret_access_key="t")
    assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"v"

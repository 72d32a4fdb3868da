"""The upkeep sweep removes what uploads that died midway left in the object store: incomplete
multipart uploads, half-written local files, and whole upload objects that no file row names (the
API killed after the object was written, before its row was committed; found by bench.chaos),
but only those older than ``abandoned_upload_seconds``, and never an object a row names."""
from __future__ import annotations

import os
import time

import boto3

from nightshift.storage.localdir import LocalDirStore
from nightshift.storage.s3 import S3Store
from nightshift.workers.storage_sweep import sweep_storage
from tests.service.factories import make_input_file, make_project


def _age(path, seconds: float) -> None:  # noqa: ANN001
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_old_uploads_without_a_row_go_young_ones_and_recorded_ones_stay(sqlite_db, settings_env, tmp_path):
    settings = settings_env(database_url=sqlite_db, storage_dir=tmp_path / "objects", abandoned_upload_seconds=3600)
    store = LocalDirStore(tmp_path / "objects")
    recorded = make_input_file(sqlite_db, store, make_project(sqlite_db), [{"custom_id": "a"}])
    store.put_stream("files/file-orphan", b"whole, but no row")
    store.put_stream("files/file-young", b"its row may be a moment away")
    store.put_stream("batches/batch_x/output.jsonl", b"not an upload")
    half = tmp_path / "objects" / "files" / ".tmp-dead"
    half.write_bytes(b"half")
    for key in (f"files/{recorded}", "files/file-orphan", "batches/batch_x/output.jsonl", "files/.tmp-dead"):
        _age(tmp_path / "objects" / key, 7200)
    assert sorted(store.keys_older_than("files/", 3600)) == [f"files/{recorded}", "files/file-orphan"]

    outcome = sweep_storage(settings, store)
    assert (outcome.abandoned, outcome.unrecorded) == (1, 1)
    assert not store.exists("files/file-orphan") and not half.exists()
    assert store.exists(f"files/{recorded}") and store.exists("files/file-young")
    assert store.exists("batches/batch_x/output.jsonl")
    assert (sweep_storage(settings, store).abandoned, sweep_storage(settings, store).unrecorded) == (0, 0)


def test_on_s3_the_sweep_aborts_multipart_uploads_and_removes_unrecorded_objects(pg_db, s3_process, settings_env):
    bucket = s3_process.new_bucket()
    client = boto3.client("s3", endpoint_url=s3_process.endpoint, region_name="us-east-1", aws_access_key_id="t",
                          aws_secret_access_key="t")
    settings = settings_env(database_url=pg_db, object_store="s3", s3_bucket=bucket,
                            s3_endpoint_url=s3_process.endpoint, s3_access_key_id="t", s3_secret_access_key="t",
                            s3_addressing_style="path", s3_prefix="tenant-a", abandoned_upload_seconds=0)
    store = S3Store(client, bucket, prefix="tenant-a")
    recorded = make_input_file(pg_db, store, make_project(pg_db), [{"custom_id": "a"}])
    store.put_stream("files/file-orphan", b"whole, but no row")
    client.put_object(Bucket=bucket, Key="other-tenant/files/file-x", Body=b"outside the prefix")
    client.create_multipart_upload(Bucket=bucket, Key="tenant-a/files/file-killed")
    time.sleep(1.1)                                   # LastModified has whole seconds
    assert sorted(store.keys_older_than("files/", 0)) == [f"files/{recorded}", "files/file-orphan"]

    outcome = sweep_storage(settings, store)
    assert (outcome.abandoned, outcome.unrecorded) == (1, 1)
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["other-tenant/files/file-x", f"tenant-a/files/{recorded}"]

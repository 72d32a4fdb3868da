"""S3 (or any S3-compatible endpoint) object store via boto3; uploads are managed multipart
transfers, so a 200 MB file streams through in fixed-size parts."""
from __future__ import annotations

import time
from typing import Iterator

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from nightshift.storage.objectstore import CHUNK, Source, as_reader


class _CountingReader:
    def __init__(self, raw):  # noqa: ANN001
        self.raw = raw
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data


def _read_up_to(reader, n: int) -> bytes:  # noqa: ANN001
    parts, size = [], 0
    while size < n:
        data = reader.read(n - size)
        if not data:
            break
        parts.append(data)
        size += len(data)
    return b"".join(parts)


class _Prefixed:
    """``head`` (already read) followed by the rest of ``raw``, as one file object."""

    def __init__(self, head: bytes, raw):  # noqa: ANN001
        self.head = head
        self.raw = raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n is None or n < 0:
                data, self.head = self.head + self.raw.read(), b""
                return data
            data, self.head = self.head[:n], self.head[n:]
            return data
        return self.raw.read(n)


class S3Store:
    def __init__(self, client, bucket: str, prefix: str = "", chunk_bytes: int = 8 * 1024 * 1024):  # noqa: ANN001
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        chunk_bytes = max(chunk_bytes, 5 * 1024 * 1024)  # S3's minimum part size
        self.transfer = TransferConfig(multipart_threshold=chunk_bytes, multipart_chunksize=chunk_bytes,
                                       max_concurrency=4, use_threads=True)

    @classmethod
    def from_settings(cls, settings) -> "S3Store":  # noqa: ANN001
        if not settings.s3_bucket:
            raise ValueError("NIGHTSHIFT_OBJECT_STORE=s3 needs NIGHTSHIFT_S3_BUCKET")
        client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            aws_access_key_id=settings.s3_access_key_id,
            aws_secret_access_key=settings.s3_secret_access_key,
            config=Config(region_name=settings.s3_region, signature_version="s3v4",
                          connect_timeout=settings.s3_connect_timeout_seconds,
                          read_timeout=settings.s3_read_timeout_seconds,
                          retries={"mode": "standard", "max_attempts": settings.s3_max_attempts},
                          s3={"addressing_style": settings.s3_addressing_style}),
        )
        store = cls(client, settings.s3_bucket, settings.s3_prefix, settings.s3_multipart_chunk_bytes)
        store.ensure_bucket(create=settings.s3_create_bucket, region=settings.s3_region)
        return store

    def ensure_bucket(self, *, create: bool, region: str) -> None:
        """Check the bucket is there and reachable, creating it if it is missing and ``create``;
        otherwise fail now with a message that says what to fix (not at the first upload)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise RuntimeError(f"S3 bucket {self.bucket!r} is not accessible ({code}): check "
                                   "NIGHTSHIFT_S3_ACCESS_KEY_ID / NIGHTSHIFT_S3_SECRET_ACCESS_KEY and the bucket "
                                   "policy") from e
        if not create:
            raise RuntimeError(f"S3 bucket {self.bucket!r} does not exist: create it, or set "
                               "NIGHTSHIFT_S3_CREATE_BUCKET=true to let Nightshift create it")
        options = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            self.client.create_bucket(Bucket=self.bucket, **options)
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) not in ("BucketAlreadyOwnedByYou",):
                raise RuntimeError(f"S3 bucket {self.bucket!r} does not exist and could not be created: {e}") from e

    def _key(self, key: str) -> str:
        return self.prefix + key

    def put_stream(self, key: str, source: Source) -> int:
        """One PUT for an object smaller than a part (most uploads: no transfer threads), a
        managed multipart upload otherwise."""
        reader = as_reader(source)
        head = _read_up_to(reader, self.transfer.multipart_threshold)
        if len(head) < self.transfer.multipart_threshold:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=head)
            return len(head)
        counting = _CountingReader(_Prefixed(head, reader))
        self.client.upload_fileobj(counting, self.bucket, self._key(key), Config=self.transfer)
        return counting.count

    def get_stream(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise KeyError(key) from e
            raise
        return obj["Body"].iter_chunks(chunk_size)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def sweep_abandoned(self, older_than_seconds: float) -> int:
        """Abort the incomplete multipart uploads under this store's prefix that began more than
        ``older_than_seconds`` ago (a process that died mid-upload leaves its parts billed and
        invisible); returns how many. A bucket lifecycle rule (AbortIncompleteMultipartUpload)
        does the same on S3 itself."""
        cutoff = time.time() - older_than_seconds
        aborted = 0
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                Prefix=self.prefix):
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
                    aborted += 1
        return aborted

    def keys_older_than(self, prefix: str, older_than_seconds: float) -> Iterator[str]:
        cutoff = time.time() - older_than_seconds
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self._key(prefix)):
            for obj in page.get("Contents", []):
                if obj["LastModified"].timestamp() < cutoff:
                    yield obj["Key"][len(self.prefix):]

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise KeyError(key) from e
            raise

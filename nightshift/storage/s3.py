"""S3 (or any S3-compatible endpoint) object store via boto3; uploads are managed multipart
transfers, so a 200 MB file streams through in fixed-size parts."""
from __future__ import annotations

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
                          retries={"mode": "standard", "max_attempts": 5},
                          s3={"addressing_style": settings.s3_addressing_style}),
        )
        return cls(client, settings.s3_bucket, settings.s3_prefix, settings.s3_multipart_chunk_bytes)

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

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise KeyError(key) from e
            raise

"""Object store interface: streamed put/get, delete, exists. Backends: S3 and a local folder."""
from __future__ import annotations

import io
from typing import BinaryIO, Iterable, Iterator, Optional, Protocol, Union

Source = Union[BinaryIO, Iterable[bytes], bytes]

CHUNK = 1024 * 1024


class ObjectStore(Protocol):
    def put_stream(self, key: str, source: Source) -> int:
        """Store ``source`` (a binary file object, an iterable of byte chunks or bytes) under
        ``key``, replacing what was there; returns the number of bytes written. Never holds
        the whole object in memory."""

    def get_stream(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Yield the object's bytes in chunks; KeyError if absent."""

    def delete(self, key: str) -> None:
        """Remove the object; absent keys are fine."""

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def sweep_abandoned(self, older_than_seconds: float) -> int:
        """Remove what writes that never finished left behind (incomplete multipart uploads,
        temporary files) older than that; returns how many."""

    def keys_older_than(self, prefix: str, older_than_seconds: float) -> Iterator[str]:
        """The keys under ``prefix`` of whole objects last written more than that long ago."""


class IterableReader(io.RawIOBase):
    """A read-only file object over an iterable of byte chunks (for boto3's upload_fileobj)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def as_reader(source: Source) -> BinaryIO:
    if isinstance(source, (bytes, bytearray)):
        return io.BytesIO(source)
    if hasattr(source, "read"):
        return source  # type: ignore[return-value]
    return io.BufferedReader(IterableReader(source), buffer_size=CHUNK)  # type: ignore[arg-type]


def iter_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a chunk stream into lines (without the trailing newline); the last line may lack one."""
    rest = b""
    for chunk in chunks:
        if not chunk:
            continue
        data = rest + chunk
        lines = data.split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


_store: dict[int, ObjectStore] = {}


def get_object_store(settings=None) -> ObjectStore:  # noqa: ANN001
    """The configured store (built once per process; boto3 clients must not cross a fork)."""
    import os

    from nightshift.settings import get_settings

    settings = settings or get_settings()
    if settings is get_settings():
        cached: Optional[ObjectStore] = _store.get(os.getpid())
        if cached is not None:
            return cached
    if settings.object_store == "s3":
        from nightshift.storage.s3 import S3Store

        store: ObjectStore = S3Store.from_settings(settings)
    else:
        from nightshift.storage.localdir import LocalDirStore

        store = LocalDirStore(settings.resolved_storage_dir)
    if settings is get_settings():
        _store[os.getpid()] = store
    return store


def reset_object_store_cache() -> None:
    _store.clear()

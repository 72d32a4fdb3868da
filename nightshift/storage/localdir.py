"""Local-folder object store (the embedded default). Writes go to a temp file then
``os.replace``, so a reader never sees half an object and a rewrite is atomic."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from nightshift.storage.objectstore import CHUNK, Source, as_reader


class LocalDirStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"object key escapes the store: {key!r}")
        return path

    def put_stream(self, key: str, source: Source) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        reader = as_reader(source)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(reader, out, CHUNK)
                written = out.tell()
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return written

    def get_stream(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        path = self._path(key)
        if not path.is_file():
            raise KeyError(key)
        return self._read(path, chunk_size)

    @staticmethod
    def _read(path: Path, chunk_size: int) -> Iterator[bytes]:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def sweep_abandoned(self, older_than_seconds: float) -> int:
        """Remove temporary files of writes that never finished (a process killed mid-write)
        older than ``older_than_seconds``; returns how many."""
        cutoff = time.time() - older_than_seconds
        removed = 0
        for tmp in self.root.rglob(".tmp-*"):
            try:
                if tmp.is_file() and tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def keys_older_than(self, prefix: str, older_than_seconds: float) -> Iterator[str]:
        cutoff = time.time() - older_than_seconds
        folder = self._path(prefix) if prefix.strip("/") else self.root
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            try:
                if path.is_file() and not path.name.startswith(".tmp-") and path.stat().st_mtime < cutoff:
                    yield path.relative_to(self.root).as_posix()
            except FileNotFoundError:   # deleted meanwhile
                continue

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise KeyError(key)
        return path.stat().st_size

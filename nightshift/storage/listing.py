"""List the keys under a prefix of an object store (schedules read document folders).

Kept beside the backends rather than in the ObjectStore protocol's core four operations;
each backend is listed its own way: a folder walk, or S3 ListObjectsV2 pages.
"""
from __future__ import annotations

import os
from typing import Iterator

from nightshift.storage.localdir import LocalDirStore
from nightshift.storage.s3 import S3Store


def list_keys(store, prefix: str) -> Iterator[str]:  # noqa: ANN001
    """Every object key that starts with `prefix`, in sorted order (temp files excluded)."""
    if isinstance(store, LocalDirStore):
        yield from _list_local(store, prefix)
    elif isinstance(store, S3Store):
        yield from _list_s3(store, prefix)
    else:
        raise TypeError(f"cannot list keys of {type(store).__name__}")


def _list_local(store: LocalDirStore, prefix: str) -> Iterator[str]:
    root = store.root.resolve()
    # walk only the folder part of the prefix, then filter by the full prefix
    folder = root / prefix.rsplit("/", 1)[0] if "/" in prefix else root
    if not folder.is_dir():
        return
    keys = []
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            if name.startswith(".tmp-"):
                continue
            key = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if key.startswith(prefix):
                keys.append(key)
    yield from sorted(keys)


def _list_s3(store: S3Store, prefix: str) -> Iterator[str]:
    paginator = store.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=store.bucket, Prefix=store.prefix + prefix):
        for item in page.get("Contents", []):
            yield item["Key"][len(store.prefix):]

"""The upkeep task's removal of expired files (rules in ``nightshift.jobs.files.expiry``), in
chunks: find expired unused files (one transaction), delete their objects (no transaction
open), then mark the rows deleted (one transaction). The object goes first, so a pass that dies
midway leaves at worst rows whose objects are gone, which the next pass finds again and
finishes; an object that cannot be deleted now (the store is down) is left, row and all, for
the next pass."""
from __future__ import annotations

import logging
import time
from typing import Optional

from nightshift.jobs.files.expiry import expired_files, mark_files_deleted
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

CHUNK = 200


def remove_expired_files(settings: Settings, store: ObjectStore, now: Optional[float] = None,
                         chunk: int = CHUNK) -> int:
    """Remove every file expired by ``now`` that nothing needs; returns how many were removed."""
    now = time.time() if now is None else now
    url = settings.resolved_database_url
    removed = 0
    while True:
        with session_scope(url) as s:
            found = expired_files(s, now, chunk)
        deleted = []
        for file_id, key in found:
            try:
                store.delete(key)
            except Exception as exc:  # noqa: BLE001 - left for the next pass
                log.warning("expired file %s: could not delete its object (%s: %s); will retry", file_id,
                            type(exc).__name__, exc)
                continue
            deleted.append(file_id)
        with session_scope(url) as s:
            removed += mark_files_deleted(s, deleted, now)
        if len(found) < chunk or not deleted:
            return removed

"""The upkeep sweep of the object store: what writes that died midway left behind.

1. incomplete multipart uploads and half-written local files older than
   ``abandoned_upload_seconds`` (the store's own ``sweep_abandoned``);
2. whole upload objects (``files/...``) that old that no file row names: an API process killed
   after the upload reached the store but before its row was committed. Which keys have rows is
   read in one short transaction per chunk; the objects are deleted with no transaction open.
An upload still in progress is younger than ``abandoned_upload_seconds``, so it is never taken.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import islice

from nightshift.jobs.files.uploads import UPLOAD_PREFIX, unrecorded_keys
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

CHUNK = 500


@dataclass
class SweepOutcome:
    abandoned: int = 0          # incomplete multipart uploads aborted, temporary files removed
    unrecorded: int = 0         # whole upload objects without a file row, removed


def sweep_storage(settings: Settings, store: ObjectStore) -> SweepOutcome:
    older = settings.abandoned_upload_seconds
    outcome = SweepOutcome(abandoned=store.sweep_abandoned(older))
    keys = iter(store.keys_older_than(UPLOAD_PREFIX, older))
    while chunk := list(islice(keys, CHUNK)):
        with session_scope(settings.resolved_database_url) as s:
            orphans = unrecorded_keys(s, chunk)
        for key in orphans:
            store.delete(key)
            log.info("storage sweep: removed %s (an upload without a file row)", key)
        outcome.unrecorded += len(orphans)
    return outcome

"""Finalize a batch in three transactions (the rules are in ``nightshift.jobs.batches.finalize``):

1. prepare: take the finalize lease, check the status, drain a cancelling batch, decide the
   terminal status; committed so the drained error lines are what step 2 reads;
2. write output.jsonl and errors.jsonl while reading the rows in a read-only session (on
   SQLite it takes no write lock for the length of the upload), renewing the lease every
   heartbeat from another thread, so a slow object store does not make it look dead;
3. commit: the conditional move to the terminal status, the file rows and the cost report.
A crash between steps leaves the batch finalizing or cancelling; once its lease runs out the
reconciler re-sends the message and the retry overwrites the same objects. A finalize that
fails with an exception (the database restarted under it, the object store timed out) hands its
lease back first, when it can, so the reconciler re-sends it within a tick. The outcome says
how the batch ended; the task then completes the batch's schedule run, if any
(``schedule_runs.complete_batch_run``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from nightshift.jobs.batches.finalize import (FinalizeOutcome, complete_finalize, prepare_finalize,
                                              release_finalize_lease, renew_finalize_lease, write_result_files)
from nightshift.jobs.batches.lifecycle import batch_status
from nightshift.settings import Settings
from nightshift.storage.db import read_only_session_scope, session_scope
from nightshift.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)


def finalize_batch(batch_id: str, *, settings: Settings, store: ObjectStore,
                   now: Optional[float] = None) -> FinalizeOutcome:
    url = settings.resolved_database_url
    with session_scope(url) as s:
        plan = prepare_finalize(s, batch_id, settings.lease_seconds, now)
        if plan is None:
            return FinalizeOutcome(batch_status(s, batch_id))
    lease = [plan.lease_expires_at]     # the lease's expiry as last written (the renewer updates it)
    stop = threading.Event()
    renewer = threading.Thread(target=_keep_lease, args=(batch_id, settings, stop, lease), daemon=True,
                               name=f"finalize-lease-{batch_id}")
    renewer.start()
    try:
        try:
            with read_only_session_scope(url) as s:
                files = write_result_files(s, store, batch_id)
        finally:
            stop.set()
            renewer.join()
        with session_scope(url) as s:
            outcome = complete_finalize(s, store, settings, plan, files, time.time() if now is None else now)
    except Exception:
        _hand_back(url, batch_id, lease[0])
        raise
    if outcome.status == plan.target:
        log.info("finalized batch %s -> %s (%d output, %d error lines)", batch_id, outcome.status,
                 outcome.output_lines, outcome.error_lines)
    return outcome


def _keep_lease(batch_id: str, settings: Settings, stop: threading.Event, lease: list[float]) -> None:
    while not stop.wait(settings.heartbeat_seconds):
        try:
            with session_scope(settings.resolved_database_url) as s:
                expires = renew_finalize_lease(s, batch_id, settings.lease_seconds)
            lease[0] = expires        # once committed
        except Exception:  # a database hiccup: the lease outlives a few missed renewals
            log.exception("finalize %s: could not renew its lease", batch_id)


def _hand_back(url: str, batch_id: str, expires_at: float) -> None:
    try:
        with session_scope(url) as s:
            if release_finalize_lease(s, batch_id, expires_at):
                log.warning("finalize %s failed; its lease is handed back for the reconciler to send it again", batch_id)
    except Exception:  # noqa: BLE001 - the database may be what failed: then the lease runs out instead
        log.warning("finalize %s failed and could not hand its lease back; it is sent again when the lease runs "
                    "out", batch_id)

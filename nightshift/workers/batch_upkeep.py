"""The beat's repairs of batches, with their transactions (the rules are in
``nightshift.jobs.batches.reconcile`` and ``lifecycle``); the tasks send the wake-ups once
these have committed."""
from __future__ import annotations

import time
from typing import Optional

from nightshift.jobs.batches.lifecycle import due_for_expiry, expire_batch
from nightshift.jobs.batches.reconcile import Actions, reconcile
from nightshift.settings import Settings
from nightshift.storage.db import session_scope


def reconcile_batches(settings: Settings, now: Optional[float] = None) -> Actions:
    """One reconciler pass in one transaction, knowing which shard, finalize and cancel wake-ups
    wait in the queues."""
    from nightshift.workers.celery_app import TASK_CANCEL, TASK_FINALIZE, TASK_RUN_SHARD, app
    from nightshift.workers.queue_peek import queued_task_args

    waiting = queued_task_args(app, "gpu", TASK_RUN_SHARD)
    queued = None if waiting is None else {args[0] for args in waiting if args}
    finalizes, cancels = (queued_task_args(app, "cpu", task) for task in (TASK_FINALIZE, TASK_CANCEL))
    queued_batches = None if finalizes is None or cancels is None else {args[0] for args in finalizes + cancels
                                                                         if args}
    with session_scope(settings.resolved_database_url) as s:
        return reconcile(s, settings, now, queued, queued_batches)


def expire_due_batches(settings: Settings, now: Optional[float] = None) -> list[str]:
    """Expire every batch past its completion window, each in its own transaction (one batch's
    drain never waits on another's locks); returns the ids to finalize."""
    now = time.time() if now is None else now
    url = settings.resolved_database_url
    with session_scope(url) as s:
        due = due_for_expiry(s, now)
    expired = []
    for batch_id in due:
        with session_scope(url) as s:
            if expire_batch(s, batch_id, now):
                expired.append(batch_id)
    return expired

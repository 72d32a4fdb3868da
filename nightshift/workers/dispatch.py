"""Send wake-up messages. Call these only after the commit that makes the work visible;
a lost message is repaired by the reconciler (or the schedules tick), a duplicate is a no-op."""
from __future__ import annotations

from nightshift.workers.celery_app import (TASK_CANCEL, TASK_DELIVER_WEBHOOKS, TASK_FINALIZE, TASK_INGEST,
                                           TASK_RUN_SHARD, TASK_SCHEDULE_START_RUN, app)


def enqueue_ingest(batch_id: str) -> None:
    app.send_task(TASK_INGEST, args=[batch_id], queue="cpu")


def enqueue_run_shard(shard_id: int) -> None:
    app.send_task(TASK_RUN_SHARD, args=[shard_id], queue="gpu")


def enqueue_finalize(batch_id: str) -> None:
    app.send_task(TASK_FINALIZE, args=[batch_id], queue="cpu")


def enqueue_cancel(batch_id: str) -> None:
    app.send_task(TASK_CANCEL, args=[batch_id], queue="cpu")


def enqueue_start_run(run_id: str) -> None:
    app.send_task(TASK_SCHEDULE_START_RUN, args=[run_id], queue="cpu")


def enqueue_deliver_webhooks() -> None:
    app.send_task(TASK_DELIVER_WEBHOOKS, queue="cpu")

"""The Celery app: Redis broker in production, kombu ``filesystem://`` in the embedded default.

Postgres is the truth; messages are wake-ups (docs/architecture.md). ``acks_late`` + prefetch 1 so a
worker holds one shard at a time and a crash re-delivers (Redis) — and if the message is
lost anyway (filesystem broker), the reconciler on beat re-sends from database state.
Queues: ``gpu`` (run_shard), ``cpu`` (ingest, finalize, cancel, a schedule run's start: work
that may wait on the object store for long) and ``upkeep`` (the beat's reconcile, expiry,
schedules tick, storage sweep and expired-file removal: short, and never stuck behind a slow
finalize). Start ``celery -A nightshift.workers.celery_app worker -Q gpu -c 1`` on engine hosts,
``... worker -Q cpu`` and ``... worker -Q upkeep -c 1`` plus ``... beat`` elsewhere. A beat tick
that waited longer than its interval is dropped (the next one does the same work). Importing
this module has no side effects beyond reading the settings.
"""
from __future__ import annotations

import os
from pathlib import Path

from celery import Celery, signals
from celery.beat import PersistentScheduler
from kombu import Queue

from nightshift.settings import Settings, get_settings

TASK_INGEST = "nightshift.ingest"
TASK_RUN_SHARD = "nightshift.run_shard"
TASK_FINALIZE = "nightshift.finalize"
TASK_CANCEL = "nightshift.cancel"
TASK_RECONCILE = "nightshift.reconcile"
TASK_EXPIRE = "nightshift.expire"
TASK_SCHEDULES_TICK = "nightshift.schedules.tick"        # tasks of schedules: workers/schedule_tasks.py
TASK_SCHEDULE_START_RUN = "nightshift.schedules.start_run"
TASK_SWEEP_STORAGE = "nightshift.sweep_storage"
TASK_EXPIRE_FILES = "nightshift.expire_files"
TASK_DELIVER_WEBHOOKS = "nightshift.deliver_webhooks"    # cpu: it waits on the receivers' answers
UPKEEP_TASKS = (TASK_RECONCILE, TASK_EXPIRE, TASK_SCHEDULES_TICK, TASK_SWEEP_STORAGE, TASK_EXPIRE_FILES)


class EmbeddedBeatScheduler(PersistentScheduler):
    """Beat's file-backed schedule, whose folder (under a home that may be new) is made when beat
    starts: it opens the file before it publishes anything, so before the broker makes its folders."""

    def setup_schedule(self) -> None:
        Path(self.schedule_filename).parent.mkdir(parents=True, exist_ok=True)
        super().setup_schedule()


def celery_config(settings: Settings) -> dict:
    """The app's configuration; pure (the embedded broker's folders are made when a connection
    first opens a channel: ``filesystem_broker.Channel``)."""
    config = {
        "broker_url": settings.resolved_broker_url,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,   # bounded by shard attempts in the DB
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "task_default_queue": "cpu",
        "task_queues": (Queue("cpu"), Queue("gpu"), Queue("upkeep")),
        "task_routes": {TASK_RUN_SHARD: {"queue": "gpu"}, **{task: {"queue": "upkeep"} for task in UPKEEP_TASKS}},
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        # A broker blip must not stop a running shard stream: its results go to the database, and
        # a redelivered copy of its message finds the shard leased (no second run, no reload).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_serializer": "json",
        "accept_content": ["json"],
        "beat_schedule": {
            name: {"task": task, "schedule": every, "options": {"queue": "upkeep", "expires": every}}
            for name, task, every in (
                ("reconcile", TASK_RECONCILE, settings.reconcile_interval_seconds),
                ("expire", TASK_EXPIRE, settings.expire_interval_seconds),
                ("schedules", TASK_SCHEDULES_TICK, settings.schedule_tick_seconds),
                ("sweep-storage", TASK_SWEEP_STORAGE, settings.storage_sweep_interval_seconds),
                ("expire-files", TASK_EXPIRE_FILES, settings.expired_files_gc_interval_seconds))
        } | {"webhooks": {"task": TASK_DELIVER_WEBHOOKS, "schedule": settings.webhook_tick_seconds,
                          "options": {"queue": "cpu", "expires": settings.webhook_tick_seconds}}},
    }
    if settings.is_embedded_broker:
        root = settings.broker_dir
        config["broker_transport_options"] = {
            "data_folder_in": str(root / "queue"), "data_folder_out": str(root / "queue"),
            "processed_folder": str(root / "processed"), "store_processed": False,
            "control_folder": str(root / "control"), "polling_interval": settings.broker_polling_interval,
        }
        config["beat_schedule_filename"] = str(root / "celerybeat-schedule")
        config["beat_scheduler"] = "nightshift.workers.celery_app:EmbeddedBeatScheduler"
        config["broker_transport"] = "nightshift.workers.filesystem_broker:Transport"   # atomic message files
    else:
        opts = {"visibility_timeout": settings.broker_visibility_timeout}
        config["broker_transport_options"] = opts
        config["result_backend_transport_options"] = opts
    return config


def make_celery(settings: Settings | None = None) -> Celery:
    app = Celery("nightshift")
    app.conf.update(celery_config(settings or get_settings()))
    app.conf.imports = ("nightshift.workers.tasks", "nightshift.workers.schedule_tasks")
    return app


app = make_celery()


_engine_worker = False      # this worker consumes the gpu queue (set before the pool forks)
_host_heartbeat = None      # an engine worker process's engine hosts heartbeat (workers/host_heartbeat.py)


@signals.worker_init.connect
def _choose_metrics_dir(sender=None, **_) -> None:   # noqa: ANN001, ANN003 - in the worker's main process, before the pool forks
    from nightshift.workers.metrics import use_metrics_dir

    global _engine_worker
    use_metrics_dir(get_settings())
    queues = getattr(getattr(getattr(sender, "app", None), "amqp", None), "queues", None)
    _engine_worker = queues is not None and "gpu" in queues.consume_from


@signals.worker_process_init.connect
def _register_engine_host(**_) -> None:   # noqa: ANN003 - in each pool process, after the fork
    global _host_heartbeat
    if _engine_worker:
        from nightshift.workers.host_heartbeat import HostHeartbeat

        _host_heartbeat = HostHeartbeat(get_settings()).start()


@signals.worker_process_shutdown.connect
def _retire_metrics(pid=None, **_) -> None:  # noqa: ANN001, ANN003
    from nightshift.workers.metrics import mark_process_dead

    if _host_heartbeat is not None:
        _host_heartbeat.stop()
    mark_process_dead(pid or os.getpid())


@signals.task_postrun.connect
def _count_task(task=None, state=None, **_) -> None:  # noqa: ANN001, ANN003
    from nightshift.workers.metrics import worker_metrics

    if task is not None:
        worker_metrics().tasks.labels(task.name, str(state)).inc()

"""An engine worker process's rows in the engine hosts table (jobs/engine_hosts): registered
when the process starts (the Celery ``worker_process_init`` signal of a worker that consumes the
gpu queue: workers/celery_app.py), renewed from a daemon thread, removed when it stops. Nothing
here imports the engine: the loads themselves (and their ready / failed marks) are
workers/engine_host.py's."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from nightshift.jobs.engine_hosts import registry
from nightshift.settings import Settings
from nightshift.storage.db import session_scope

log = logging.getLogger(__name__)


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def served_models(settings: Settings) -> dict[str, tuple[str, set[str]]]:
    """kind -> (the model as configured, the names a line may call it by)."""
    return {registry.CHAT: (settings.model, settings.accepted_model_names()),
            registry.EMBEDDINGS: (settings.embedding_model, settings.accepted_embedding_model_names())}


def update_host_row(settings: Settings, write: Callable) -> None:  # noqa: ANN001
    try:
        with session_scope(settings.resolved_database_url) as s:
            write(s, time.time())
    except Exception:  # noqa: BLE001 - the table is advisory; the database may be away for a moment
        log.warning("could not update this worker's engine hosts row", exc_info=True)


class HostHeartbeat:
    """An engine worker process's engine hosts rows: registered when it starts, renewed every
    ``engine_host_heartbeat_seconds`` from a daemon thread (registered again if they vanished),
    removed when it stops. The database may be away at times: a missed beat is retried next time."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker = worker_identity()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-host-heartbeat")

    def start(self) -> "HostHeartbeat":
        self._thread.start()
        return self

    def _register(self, s, now: float) -> None:  # noqa: ANN001
        for kind, (model, names) in served_models(self.settings).items():
            registry.register(s, self.worker, kind, model, names, now)

    def _run(self) -> None:
        registered = False
        while True:
            try:
                with session_scope(self.settings.resolved_database_url) as s:
                    now = time.time()
                    if not registered or not registry.heartbeat(s, self.worker, now):
                        self._register(s, now)
                registered = True
            except Exception:  # noqa: BLE001 - the database may be away: beat again next time
                log.debug("engine host heartbeat failed", exc_info=True)
            if self._stop.wait(self.settings.engine_host_heartbeat_seconds):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        update_host_row(self.settings, lambda s, now: registry.unregister(s, self.worker))

"""``nightshift serve``: the whole service in one process tree.

The API runs in this process (uvicorn); three Celery workers run as children: one for the
``gpu`` queue (the engine, one task at a time), one for the ``cpu`` queue (ingest, finalize,
cancel) and one for the ``upkeep`` queue with the beat scheduler inside it (reconcile, expiry,
schedules, storage sweep). With no URLs configured
that is SQLite, a local folder and kombu's ``filesystem://`` broker under NIGHTSHIFT_HOME —
the same code paths as production, where each part runs on its own machines.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from nightshift.jobs.projects.api_keys import generate_key
from nightshift.settings import Settings, get_settings
from nightshift.workers import procs
from nightshift.workers.metrics import use_metrics_dir

# The engine worker runs at a lower CPU priority: on one machine the API must answer polls
# promptly while the engine keeps every core busy; with the API idle the engine loses nothing.
# The upkeep worker (reconcile, expiry, schedules, sweeps; with beat) has its own process, so a
# finalize stuck on a slow object store never holds up recovery.
WORKERS = {"gpu": {"queues": "gpu", "nice": 10}, "cpu": {"queues": "cpu"},
           "upkeep": {"queues": "upkeep", "beat": True}}


def local_key(settings: Settings) -> str:
    """The configured bootstrap key, or this home's own key (made once, kept in <home>/api_key)."""
    if settings.bootstrap_key:
        return settings.bootstrap_key
    from nightshift.api.cli_client import KEY_FILE_NAME

    path = settings.home / KEY_FILE_NAME
    if path.is_file():
        return path.read_text().strip()
    key = generate_key()
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def start_workers(home: Path) -> list[subprocess.Popen]:
    """One worker per queue kind, logging to <home>/logs/<kind>.log (nightshift.workers.procs)."""
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    return [procs.start_worker(dict(os.environ), name=kind, log_path=logs / f"{kind}.log", die_with_parent=True,
                               **opts) for kind, opts in WORKERS.items()]


def stop_workers(children: list[subprocess.Popen], grace_seconds: float) -> None:
    """Warm shutdown of all workers at once; whatever still runs after ``grace_seconds`` is
    killed with its process group. A shard stopped midway keeps its rows pending: its lease
    runs out and the reconciler sends it again (leases, not messages, hold the truth: docs/architecture.md)."""
    for child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_seconds
    for child in children:
        procs.stop(child, timeout=max(0.0, deadline - time.monotonic()))


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    import uvicorn

    from nightshift.api.app import create_app
    from nightshift.migrations import upgrade_head

    home = Path(get_settings().home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["NIGHTSHIFT_HOME"] = str(home)          # children inherit one absolute home
    get_settings.cache_clear()
    settings = get_settings()
    os.environ["NIGHTSHIFT_BOOTSTRAP_KEY"] = local_key(settings)
    get_settings.cache_clear()

    upgrade_head(settings.resolved_database_url)
    # One metrics directory for the API and every worker of this tree; the one serve chooses
    # itself is emptied first (an earlier run's samples must not add to this one's).
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(home / "metrics", ignore_errors=True)
    use_metrics_dir(settings)
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, give in-flight requests
    # timeout_graceful_shutdown seconds) and re-raises the signal once it is done; that re-raise
    # becomes SystemExit here, so the `finally` below still stops the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children = start_workers(home)
    print(f"nightshift: API on http://{host}:{port}/v1; state, API key and worker logs in {home}",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=max(1, round(settings.shutdown_seconds)))
    finally:
        stop_workers(children, settings.shutdown_seconds)
    return 0

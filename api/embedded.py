"""``nightshift serve``: the whole service in one process tree.

The API runs in this process (uvicorn); two Celery workers run as children: one for the
``gpu`` queue (the engine, one task at a time) and one for the ``cpu`` queue with the beat
scheduler inside it (ingest, finalize, cancel, reconcile, expiry). With no URLs configured
that is SQLite, a local folder and kombu's ``filesystem://`` broker under NIGHTSHIFT_HOME —
the same code paths as production, where each part runs on its own machines.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

from jobs.keys import generate_key
from jobs.settings import Settings, get_settings

CELERY = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker"]
WORKERS = {
    "gpu": ["-Q", "gpu", "-c", "1", "-n", "gpu@%h"],
    "cpu": ["-Q", "cpu", "-c", "1", "-n", "cpu@%h", "--beat"],
}


def _die_with_parent() -> None:
    # A child gets SIGTERM when `serve` dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def local_key(settings: Settings) -> str:
    """The configured bootstrap key, or this home's own key (made once, kept in <home>/api_key)."""
    if settings.bootstrap_key:
        return settings.bootstrap_key
    from api.cli_client import KEY_FILE_NAME

    path = settings.home / KEY_FILE_NAME
    if path.is_file():
        return path.read_text().strip()
    key = generate_key()
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def start_workers(log_level: str) -> list[subprocess.Popen]:
    return [subprocess.Popen(CELERY + args + ["--loglevel", log_level.upper()], preexec_fn=_die_with_parent)
            for args in WORKERS.values()]


def stop(children: list[subprocess.Popen], timeout: float = 20.0) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    import uvicorn

    from api.app import create_app
    from storage.db import upgrade_head

    home = Path(get_settings().home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["NIGHTSHIFT_HOME"] = str(home)          # children inherit one absolute home
    get_settings.cache_clear()
    settings = get_settings()
    os.environ["NIGHTSHIFT_BOOTSTRAP_KEY"] = local_key(settings)
    get_settings.cache_clear()

    upgrade_head(settings.resolved_database_url)
    children = start_workers(log_level)
    print(f"nightshift: API on http://{host}:{port}/v1, state in {home}, "
          f"key in NIGHTSHIFT_BOOTSTRAP_KEY or {home / 'api_key'}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(), host=host, port=port, log_level=log_level)
    finally:
        stop(children)
    return 0

"""Start and stop `celery worker` subprocesses (benchmarks, tests, a one-command launcher).

Each worker gets its own process group, so it can be stopped (or SIGKILLed in a crash test)
together with its pool children."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

# The folder holding the `nightshift` package (the repository in a checkout): children get it on
# PYTHONPATH, so they import this same copy of the code.
REPO = Path(__file__).resolve().parents[2]


def service_env(**nightshift: object) -> dict[str, str]:
    """This process's environment without NIGHTSHIFT_* (except the model cache), plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_") or k == "NIGHTSHIFT_MODEL_CACHE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for key, value in nightshift.items():
        env[f"NIGHTSHIFT_{key.upper()}"] = str(value)
    return env


def _die_with_parent() -> None:
    # Linux prctl(PR_SET_PDEATHSIG, SIGTERM): the worker is told to stop when its starter dies,
    # even by SIGKILL, so a launcher never leaves orphaned workers behind.
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def start_worker(env: dict[str, str], queues: str, name: str, log_path: Path, beat: bool = False,
                 concurrency: int = 1, die_with_parent: bool = False, nice: int = 0) -> subprocess.Popen:
    """``nice`` lowers the worker's CPU priority (the embedded engine worker yields the cores
    to the API on a shared machine; alone, it runs exactly as fast)."""
    cmd = [sys.executable, "-m", "celery", "-A", "nightshift.workers.celery_app", "worker", "-Q", queues, "-c", str(concurrency),
           "-n", f"{name}@%h", "--loglevel", "INFO", "--without-gossip", "--without-mingle"]
    if beat:
        cmd += ["-B", "-s", str(log_path.parent / f"{name}-beat-schedule")]
    log = open(log_path, "ab")

    def prepare_child() -> None:
        if die_with_parent:
            _die_with_parent()
        if nice:
            os.nice(nice)

    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=prepare_child if die_with_parent or nice else None)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Warm shutdown (SIGTERM to the group), then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)

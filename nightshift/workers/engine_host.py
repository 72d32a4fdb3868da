"""One long-lived engine per worker process, loaded lazily on the first task that needs it, and
what happens when a model cannot load (each load's outcome is marked on the worker's engine
hosts row, which workers/host_heartbeat.py registers).

Never load in the parent before Celery forks (CUDA does not survive fork, and
``worker_process_init`` must return within 4 s); the pid check makes a forked child load
its own copy instead of reusing a parent's.

A load that fails (the model's file or package missing, out of memory) is not retried at once:
the process waits ``model_load_retry_seconds``, doubling up to ``model_load_retry_max_seconds``,
before it tries again, and meanwhile ``get_engine`` raises ``ModelUnavailable`` without trying
(the task leaves the shard for later). The cause is logged once (again only when it changes),
counted in ``nightshift_engine_load_failures_total`` and shown by the gauge
``nightshift_engine_load_failed{kind, model}``, and written to the worker's engine hosts row.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from nightshift.jobs.engine_hosts import registry
from nightshift.settings import Settings, get_settings
from nightshift.workers.host_heartbeat import served_models, update_host_row, worker_identity
from nightshift.workers.metrics import observe_step, worker_metrics

__all__ = ["ModelUnavailable", "engine_device", "engine_options", "get_embedding_engine", "get_engine", "get_tokenizer",
           "worker_identity"]

log = logging.getLogger(__name__)

# Settings field -> Engine.from_pretrained argument. A field left unset (None) is not passed,
# so the engine's own default applies: its defaults are written in one place only.
ENGINE_OPTIONS = {"quantization": "quantization", "device": "device", "engine_max_num_seqs": "max_num_seqs",
                  "engine_max_num_batched_tokens": "max_num_batched_tokens",
                  "engine_num_kv_blocks": "num_kv_blocks", "engine_enforce_eager": "enforce_eager"}

_lock = threading.Lock()
_engine = None
_engine_pid: Optional[int] = None
_tokenizer = None
_tokenizer_pid: Optional[int] = None
_embedding_engine = None
_embedding_engine_pid: Optional[int] = None

# Settings field -> EmbeddingEngine.from_pretrained argument (unset: the engine's default).
EMBEDDING_ENGINE_OPTIONS = {"embedding_device": "device", "embedding_max_batch_tokens": "max_batch_tokens",
                            "embedding_workers": "workers"}


class ModelUnavailable(RuntimeError):
    """This worker cannot load its ``kind`` model now: the load just failed (``attempted``) or
    an earlier one did and the next try is ``retry_in`` seconds away."""

    def __init__(self, kind: str, model: str, cause: str, attempted: bool, retry_in: float):
        super().__init__(f"the {kind} model {model!r} could not be loaded: {cause}")
        self.kind, self.model, self.cause, self.attempted, self.retry_in = kind, model, cause, attempted, retry_in


@dataclass
class _LoadFailures:
    """A kind's failed loads in a row in this process, and when to try again (monotonic)."""
    count: int = 0
    retry_at: float = 0.0
    cause: Optional[str] = None


_failures: dict[str, _LoadFailures] = {}


def engine_options(settings: Settings) -> dict:
    """The Engine.from_pretrained keyword arguments the settings set explicitly."""
    return {arg: getattr(settings, field) for field, arg in ENGINE_OPTIONS.items()
            if getattr(settings, field) is not None}


def _load(kind: str, settings: Settings, load: Callable[[], object]) -> object:
    """``load()``, unless this kind's last load failed and its back-off has not passed; the
    outcome recorded (log, metrics, engine hosts row). Called under ``_lock``."""
    model = served_models(settings)[kind][0]
    failures = _failures.setdefault(kind, _LoadFailures())
    if failures.count and time.monotonic() < failures.retry_at:
        raise ModelUnavailable(kind, model, failures.cause or "", False, failures.retry_at - time.monotonic())
    started = time.monotonic()
    try:
        engine = load()
    except Exception as exc:  # noqa: BLE001 - whatever stops the model from loading
        from nightshift.workers.ingest import describe_failure

        cause = describe_failure(exc, limit=500)
        failures.count += 1
        delay = min(settings.model_load_retry_max_seconds,
                    settings.model_load_retry_seconds * 2 ** (failures.count - 1))
        failures.retry_at = time.monotonic() + delay
        if cause != failures.cause:
            log.error("cannot load the %s model %s: %s (tried %d time(s); its shards wait, next try in %.0f s)",
                      kind, model, cause, failures.count, delay)
            log.debug("the failed load's traceback", exc_info=True)
        failures.cause = cause
        metrics = worker_metrics()
        metrics.load_failures.labels(kind, model).inc()
        metrics.load_failed.labels(kind, model).set(1)
        update_host_row(settings, lambda s, now: registry.mark_failed(s, worker_identity(), kind, cause, failures.count,
                                                                  time.time() + delay, now))
        raise ModelUnavailable(kind, model, cause, True, delay) from None
    if failures.count:
        log.warning("the %s model %s loaded after %d failed attempt(s)", kind, model, failures.count)
    _failures[kind] = _LoadFailures()
    worker_metrics().load_failed.labels(kind, model).set(0)
    log.info("loaded the %s model %s in %.1f s (%s)", kind, model, time.monotonic() - started,
             getattr(engine, "compute", "?"))
    update_host_row(settings, lambda s, now: registry.mark_ready(s, worker_identity(), kind, now))
    return engine


def get_engine(settings: Optional[Settings] = None):  # noqa: ANN201
    """The chat engine of this process (ModelUnavailable if it cannot load)."""
    global _engine, _engine_pid
    with _lock:
        if _engine is None or _engine_pid != os.getpid():
            from nightshift.engine import Engine

            s = settings or get_settings()
            _engine = _load(registry.CHAT, s, lambda: Engine.from_pretrained(model=s.model, **engine_options(s)))
            _engine.step_listeners.append(observe_step)
            _engine_pid = os.getpid()
        return _engine


def get_embedding_engine(settings: Optional[Settings] = None):  # noqa: ANN201
    """The embedding engine of /v1/embeddings shards, loaded on first use (beside the chat
    engine when a worker runs both kinds of shard); ModelUnavailable if it cannot load."""
    global _embedding_engine, _embedding_engine_pid
    with _lock:
        if _embedding_engine is None or _embedding_engine_pid != os.getpid():
            from nightshift.engine.embeddings import EmbeddingEngine

            s = settings or get_settings()
            options = {arg: getattr(s, field) for field, arg in EMBEDDING_ENGINE_OPTIONS.items()
                       if getattr(s, field) is not None}
            _embedding_engine = _load(registry.EMBEDDINGS, s,
                                      lambda: EmbeddingEngine.from_pretrained(model=s.embedding_model, **options))
            _embedding_engine_pid = os.getpid()
        return _embedding_engine


def engine_device(engine) -> str:  # noqa: ANN001
    runner = getattr(engine, "runner", None)
    if runner is None and hasattr(engine, "encoder"):   # the embedding engine
        return str(engine.encoder.device)
    return str(getattr(runner, "device", "unknown"))


def get_tokenizer(settings: Optional[Settings] = None):  # noqa: ANN201
    """The model's tokenizer only (cheap: no weights); the engine's own when it is loaded."""
    global _tokenizer, _tokenizer_pid
    with _lock:
        if _engine is not None and _engine_pid == os.getpid():
            return _engine.tokenizer
        if _tokenizer is None or _tokenizer_pid != os.getpid():
            from nightshift.engine import load_tokenizer

            _tokenizer = load_tokenizer((settings or get_settings()).model)
            _tokenizer_pid = os.getpid()
        return _tokenizer

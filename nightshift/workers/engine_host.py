"""One long-lived engine per worker process, loaded lazily on the first task that needs it.

Never load in the parent before Celery forks (CUDA does not survive fork, and
``worker_process_init`` must return within 4 s); the pid check makes a forked child load
its own copy instead of reusing a parent's.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Optional

from nightshift.settings import Settings, get_settings
from nightshift.workers.metrics import observe_step

# Settings field -> Engine.from_pretrained argument. A field left unset (None) is not passed,
# so the engine's own default applies: its defaults are written in one place only.
ENGINE_OPTIONS = {"quantization": "quantization", "device": "device", "engine_max_num_seqs": "max_num_seqs",
                  "engine_max_num_batched_tokens": "max_num_batched_tokens",
                  "engine_num_kv_blocks": "num_kv_blocks"}

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


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def engine_options(settings: Settings) -> dict:
    """The Engine.from_pretrained keyword arguments the settings set explicitly."""
    return {arg: getattr(settings, field) for field, arg in ENGINE_OPTIONS.items()
            if getattr(settings, field) is not None}


def get_engine(settings: Optional[Settings] = None):  # noqa: ANN201
    global _engine, _engine_pid
    with _lock:
        if _engine is None or _engine_pid != os.getpid():
            from nightshift.engine import Engine

            s = settings or get_settings()
            _engine = Engine.from_pretrained(model=s.model, **engine_options(s))
            _engine.step_listeners.append(observe_step)
            _engine_pid = os.getpid()
        return _engine


def get_embedding_engine(settings: Optional[Settings] = None):  # noqa: ANN201
    """The embedding engine of /v1/embeddings shards, loaded on first use (beside the chat
    engine when a worker runs both kinds of shard)."""
    global _embedding_engine, _embedding_engine_pid
    with _lock:
        if _embedding_engine is None or _embedding_engine_pid != os.getpid():
            from nightshift.engine.embeddings import EmbeddingEngine

            s = settings or get_settings()
            options = {arg: getattr(s, field) for field, arg in EMBEDDING_ENGINE_OPTIONS.items()
                       if getattr(s, field) is not None}
            _embedding_engine = EmbeddingEngine.from_pretrained(model=s.embedding_model, **options)
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

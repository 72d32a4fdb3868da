"""One row per engine worker process and kind of model it runs (chat, embeddings): what it
serves, whether the model is loaded, and when the worker last said it was alive."""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import JSON, Float, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from nightshift.jobs.orm import Base


class HostState:
    STARTING = "starting"      # registered; the model is loaded on the first shard (lazily)
    READY = "ready"            # the model is loaded
    FAILED = "failed"          # the last load failed: `error`, retried from `retry_at`


class EngineHost(Base):
    __tablename__ = "engine_hosts"
    worker: Mapped[str] = mapped_column(String(256), primary_key=True)     # host:pid of the process
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)        # "chat" | "embeddings"
    model: Mapped[str] = mapped_column(String(1024))                      # as configured (name or path)
    names: Mapped[list[Any]] = mapped_column(JSON)                        # what a line's "model" may say
    state: Mapped[str] = mapped_column(String(16), default=HostState.STARTING)
    error: Mapped[Optional[str]] = mapped_column(Text)                    # why the last load failed
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")   # loads failed in a row
    retry_at: Mapped[Optional[float]] = mapped_column(Float)              # the next load attempt (failed)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_engine_hosts_kind_heartbeat_at", "kind", "heartbeat_at"),)

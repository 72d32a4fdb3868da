"""Tables of a batch: the batch, its shards (units of engine work, leased by one worker at a
time) and one request row per input line.

Counters that change while a batch runs live on the shard rows (only the lease holder writes
them, so there is no hot batch row); batch totals are sums over its shards.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import (JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text,
                        UniqueConstraint)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from nightshift.jobs.files.models import File
from nightshift.jobs.orm import Base, BigIntPK, now
from nightshift.jobs.projects.models import Project


class BatchStatus:
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    TERMINAL = (FAILED, COMPLETED, EXPIRED, CANCELLED)
    ALL = (VALIDATING, FAILED, IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED, CANCELLING, CANCELLED)


class ShardStatus:
    PENDING = "pending"        # waiting for a worker (its message may or may not be queued)
    RUNNING = "running"        # leased by lease_owner until lease_expires_at
    DONE = "done"              # every request terminal
    CANCELLED = "cancelled"    # lease revoked by cancel/expiry; remaining requests drained
    TERMINAL = (DONE, CANCELLED)


class RequestStatus:
    PENDING = "pending"
    COMPLETED = "completed"    # 200 response -> output file
    FAILED = "failed"          # rejected by the model (400 response) or never run (error) -> error file


class Batch(Base):
    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey(Project.id, ondelete="CASCADE"))
    input_file_id: Mapped[str] = mapped_column(ForeignKey(File.id))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.VALIDATING, index=True)
    model: Mapped[Optional[str]] = mapped_column(String(200))        # body.model of the lines
    metadata_: Mapped[Optional[dict[str, Any]]] = mapped_column("metadata", JSON)
    errors: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)   # {"object":"list","data":[...]}
    output_file_id: Mapped[Optional[str]] = mapped_column(String(64))
    error_file_id: Mapped[Optional[str]] = mapped_column(String(64))
    output_expires_after_seconds: Mapped[Optional[int]] = mapped_column(Integer)

    created_at: Mapped[float] = mapped_column(Float, default=now)
    in_progress_at: Mapped[Optional[float]] = mapped_column(Float)
    expires_at: Mapped[Optional[float]] = mapped_column(Float)
    finalizing_at: Mapped[Optional[float]] = mapped_column(Float)
    completed_at: Mapped[Optional[float]] = mapped_column(Float)
    failed_at: Mapped[Optional[float]] = mapped_column(Float)
    expired_at: Mapped[Optional[float]] = mapped_column(Float)
    cancelling_at: Mapped[Optional[float]] = mapped_column(Float)
    cancelled_at: Mapped[Optional[float]] = mapped_column(Float)

    # Fixed at ingest (progress denominators)
    request_total: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    planned_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    planned_max_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Wake-up bookkeeping for the reconciler (when the last Celery message for this batch was sent)
    last_enqueued_at: Mapped[Optional[float]] = mapped_column(Float)
    # A running finalize holds this lease (renewed while it writes); the reconciler re-sends the
    # finalize of a finalizing batch only once it has run out.
    finalize_lease_expires_at: Mapped[Optional[float]] = mapped_column(Float)
    # Ingest runs that started; past max_ingest_attempts the batch fails instead of looping.
    ingest_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    shards: Mapped[list["Shard"]] = relationship(back_populates="batch", order_by="Shard.seq")

    __table_args__ = (Index("ix_batches_project_id_created_at", "project_id", "created_at"),)


class Shard(Base):
    __tablename__ = "shards"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey(Batch.id, ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)                        # order within the batch
    status: Mapped[str] = mapped_column(String(16), default=ShardStatus.PENDING)
    num_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    planned_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")   # prompt + max_tokens

    # Lease: terminal writes are compare-and-set on lease_token
    lease_owner: Mapped[Optional[str]] = mapped_column(String(256))
    lease_token: Mapped[Optional[str]] = mapped_column(String(64))
    lease_expires_at: Mapped[Optional[float]] = mapped_column(Float)
    heartbeat_at: Mapped[Optional[float]] = mapped_column(Float)
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    enqueued_at: Mapped[Optional[float]] = mapped_column(Float)
    started_at: Mapped[Optional[float]] = mapped_column(Float)     # first claim
    finished_at: Mapped[Optional[float]] = mapped_column(Float)
    last_error: Mapped[Optional[str]] = mapped_column(Text)
    # While no worker can load the batch's model: what the last load attempt said (the batch's
    # progress shows it), and since when its shard waits for one (cleared when a worker claims it)
    load_error: Mapped[Optional[str]] = mapped_column(Text)
    unavailable_since: Mapped[Optional[float]] = mapped_column(Float)
    worker: Mapped[Optional[str]] = mapped_column(String(256))
    device: Mapped[Optional[str]] = mapped_column(String(64))

    # Running totals over this shard's terminal requests (written with them, same transaction)
    completed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failed_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    prefix_hit_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # prompt tokens from the prefix cache
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")

    batch: Mapped[Batch] = relationship(back_populates="shards")

    __table_args__ = (
        UniqueConstraint("batch_id", "seq"),
        Index("ix_shards_status_lease_expires_at", "status", "lease_expires_at"),
    )


class Request(Base):
    """One row per input line."""

    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey(Batch.id, ondelete="CASCADE"))
    shard_id: Mapped[Optional[int]] = mapped_column(ForeignKey(Shard.id, ondelete="SET NULL"))
    line: Mapped[int] = mapped_column(Integer)                       # 1-based line in the input file
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[int]] = mapped_column(JSON)
    max_tokens: Mapped[Optional[int]] = mapped_column(Integer)       # as requested (None: default)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.PENDING)

    # Result (response_body for 200 and for a 400 the model gave; error_* for never-run lines)
    response_status_code: Mapped[Optional[int]] = mapped_column(Integer)
    response_body: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)
    error_code: Mapped[Optional[str]] = mapped_column(String(64))
    error_message: Mapped[Optional[str]] = mapped_column(Text)
    finish_reason: Mapped[Optional[str]] = mapped_column(String(16))

    # Accounting: what this request consumed, written once with its result (cost reports sum these)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    worker: Mapped[Optional[str]] = mapped_column(String(256))
    device: Mapped[Optional[str]] = mapped_column(String(64))
    attempt: Mapped[Optional[int]] = mapped_column(Integer)          # shard attempt that wrote it
    queued_at: Mapped[Optional[float]] = mapped_column(Float)        # ingested
    started_at: Mapped[Optional[float]] = mapped_column(Float)       # its shard attempt started
    first_token_at: Mapped[Optional[float]] = mapped_column(Float)
    finished_at: Mapped[Optional[float]] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_requests_batch_id_line", "batch_id", "line"),
        Index("ix_requests_shard_id_status", "shard_id", "status"),
    )

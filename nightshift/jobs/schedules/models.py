"""Tables of schedules: schedules, their runs, and the documents each has indexed.

Exactly-once firing rests on the unique key (schedule_id, due_at) of schedule_runs: whoever
inserts the row owns the run.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from nightshift.jobs.batches.models import Batch
from nightshift.jobs.orm import Base, now
from nightshift.jobs.projects.models import Project


class ScheduleStatus:
    ACTIVE = "active"
    PAUSED = "paused"


class RunStatus:
    PENDING = "pending"        # fired; its batch is not created yet
    SUBMITTED = "submitted"    # batch created and running
    SUCCEEDED = "succeeded"    # batch finished, results published (or nothing had changed)
    FAILED = "failed"          # batch failed/expired/cancelled or the run could not start
    SKIPPED = "skipped"        # the previous run was still going at this due time
    ACTIVE = (PENDING, SUBMITTED)


class Schedule(Base):
    __tablename__ = "schedules"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey(Project.id, ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    cron: Mapped[str] = mapped_column(String(120))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    status: Mapped[str] = mapped_column(String(16), default=ScheduleStatus.ACTIVE)

    # Job template
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    source: Mapped[dict[str, Any]] = mapped_column(JSON)     # {"type": "prefix"|"file", ...}
    prompt_template: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON)
    index_prefix: Mapped[Optional[str]] = mapped_column(String(1024))
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    metadata_: Mapped[Optional[dict[str, Any]]] = mapped_column("metadata", JSON)

    # Due times strictly after fire_after may fire; next_due_at is the first of them.
    fire_after: Mapped[float] = mapped_column(Float)
    next_due_at: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    updated_at: Mapped[float] = mapped_column(Float, default=now)

    __table_args__ = (
        UniqueConstraint("project_id", "name"),
        Index("ix_schedules_status_next_due_at", "status", "next_due_at"),
    )


class ScheduleRun(Base):
    __tablename__ = "schedule_runs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    schedule_id: Mapped[str] = mapped_column(ForeignKey(Schedule.id, ondelete="CASCADE"))
    due_at: Mapped[float] = mapped_column(Float)
    fired_at: Mapped[float] = mapped_column(Float, default=now)
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.PENDING)
    batch_id: Mapped[Optional[str]] = mapped_column(ForeignKey(Batch.id, ondelete="SET NULL"), index=True)
    input_file_id: Mapped[Optional[str]] = mapped_column(String(64))
    documents_total: Mapped[int] = mapped_column(Integer, default=0)
    documents_selected: Mapped[int] = mapped_column(Integer, default=0)
    documents_indexed: Mapped[int] = mapped_column(Integer, default=0)
    documents_failed: Mapped[int] = mapped_column(Integer, default=0)
    documents_removed: Mapped[int] = mapped_column(Integer, default=0)
    # {document key: sha256} of the documents sent in this run (recorded as indexed on success)
    selection: Mapped[Optional[dict[str, str]]] = mapped_column(JSON)
    removed: Mapped[Optional[list[str]]] = mapped_column(JSON)
    error: Mapped[Optional[str]] = mapped_column(Text)
    finished_at: Mapped[Optional[float]] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("schedule_id", "due_at"),   # the run key: one run per due time
        Index("ix_schedule_runs_status_fired_at", "status", "fired_at"),
    )


class IndexedDocument(Base):
    """The last successfully indexed content of each document of a schedule."""

    __tablename__ = "indexed_documents"
    schedule_id: Mapped[str] = mapped_column(ForeignKey(Schedule.id, ondelete="CASCADE"), primary_key=True)
    doc_key: Mapped[str] = mapped_column(String(1024), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    output_key: Mapped[str] = mapped_column(String(1024))
    run_id: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str] = mapped_column(String(64))
    indexed_at: Mapped[float] = mapped_column(Float)

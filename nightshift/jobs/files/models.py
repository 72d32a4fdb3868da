"""The files table: one row per stored object a project can see (uploads and batch results)."""
from __future__ import annotations

from typing import Optional

from sqlalchemy import BigInteger, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from nightshift.jobs.orm import Base, now
from nightshift.jobs.projects.models import Project


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey(Project.id, ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))                 # batch | batch_output | ...
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    object_key: Mapped[str] = mapped_column(String(1024))
    status: Mapped[str] = mapped_column(String(16), default="processed")  # uploaded | processed | error
    status_details: Mapped[Optional[str]] = mapped_column(Text)
    line_count: Mapped[Optional[int]] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float, default=now, index=True)
    expires_at: Mapped[Optional[float]] = mapped_column(Float)
    deleted_at: Mapped[Optional[float]] = mapped_column(Float)

"""Tables of tenancy: projects, and API keys stored only as hashes."""
from __future__ import annotations

from typing import Optional

from sqlalchemy import Float, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from nightshift.jobs.orm import Base, now


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey(Project.id, ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)   # sha256 hex of the secret
    key_prefix: Mapped[str] = mapped_column(String(32))              # first characters, for display
    name: Mapped[Optional[str]] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float, default=now)
    last_used_at: Mapped[Optional[float]] = mapped_column(Float)
    revoked_at: Mapped[Optional[float]] = mapped_column(Float)


class ConsoleSession(Base):
    """A browser's login to the console (api/console/): made by exchanging an API key, which is
    not kept; the browser holds only the session's own random token, stored here as its SHA-256.
    It lasts while its key is not revoked and ``expires_at`` has not passed."""

    __tablename__ = "console_sessions"
    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey(ApiKey.id, ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))              # sent back with every POST of the session
    created_at: Mapped[float] = mapped_column(Float, default=now)
    expires_at: Mapped[float] = mapped_column(Float, index=True)

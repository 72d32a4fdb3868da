"""API keys: one secret per key, stored only as its SHA-256 (keys are 256-bit random, so a
fast hash is enough: no dictionary to attack), each belonging to a project. Keys are listed
without their secret (a short prefix of a long secret at most) and revoked by id; a revoked
key is refused from the next request on (every request looks its key up)."""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nightshift.jobs.errors import NotFound
from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import ApiKey, Project

KEY_PREFIX = "ns-"
# A key's first characters are kept for display only when the secret is this long, and at most
# SHOWN_PREFIX_CHARS of them are shown: a short (hand-chosen bootstrap) key is never shown in part.
MIN_CHARS_FOR_PREFIX = 20
SHOWN_PREFIX_CHARS = 6


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_project(session: Session, name: str) -> Project:
    name = name.strip()
    if not name:
        raise ValueError("a project needs a non-empty name")
    project = session.scalar(select(Project).where(Project.name == name))
    if project is not None:
        return project
    project = Project(id=new_id("proj_"), name=name)
    try:
        with session.begin_nested():  # another process may create the same project now
            session.add(project)
    except IntegrityError:
        project = session.scalar(select(Project).where(Project.name == name))
    return project


def create_key(session: Session, project_name: str, *, key: Optional[str] = None,
               name: Optional[str] = None) -> tuple[ApiKey, str]:
    """Add a key to the project (created if new); returns the row and the secret, which is
    shown once and never stored. ``key`` supplies the secret (the bootstrap key)."""
    secret = key or generate_key()
    project = get_or_create_project(session, project_name)
    row = ApiKey(id=new_id("key_"), project_id=project.id, key_hash=hash_key(secret),
                 key_prefix=secret[:8] if len(secret) >= MIN_CHARS_FOR_PREFIX else "", name=name)
    session.add(row)
    session.flush()
    return row, secret


def ensure_key(session: Session, project_name: str, key: str) -> ApiKey:
    """Make ``key`` a valid key of ``project_name`` (idempotent; used for NIGHTSHIFT_BOOTSTRAP_KEY)."""
    existing = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    if existing is not None:
        return existing
    try:
        with session.begin_nested():
            row, _ = create_key(session, project_name, key=key, name="bootstrap")
        return row
    except IntegrityError:  # a concurrent start-up stored it first
        return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))


# Every API request runs this: built once, as a Core statement (no per-call expression building).
_keys = ApiKey.__table__
_PROJECT_OF_KEY = select(_keys.c.project_id).where(_keys.c.key_hash == bindparam("key_hash"),
                                                   _keys.c.revoked_at.is_(None))


def project_for_key(session: Session, key: str) -> Optional[str]:
    """The project id the key belongs to, or None for an unknown or revoked key."""
    return session.scalar(_PROJECT_OF_KEY, {"key_hash": hash_key(key)})


def key_for_secret(session: Session, key: str) -> Optional[ApiKey]:
    """The row of a valid key (not revoked), or None."""
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown of a key: never its secret."""

    id: str
    project: str
    name: Optional[str]
    created_at: float
    prefix: str                      # e.g. "ns-AbC…" ("" when nothing can be shown safely)
    revoked_at: Optional[float]


def shown_prefix(row: ApiKey) -> str:
    """The first characters of the key, for telling keys apart; empty unless the stored prefix is
    a full 8 characters that are not the whole secret (rows written before short keys kept none)."""
    stored = row.key_prefix or ""
    if len(stored) < 8 or hash_key(stored) == row.key_hash:
        return ""
    return stored[:SHOWN_PREFIX_CHARS] + "…"


def list_keys(session: Session, project_name: Optional[str] = None) -> list[KeyInfo]:
    """Every key (or the named project's), oldest first, revoked ones included."""
    query = select(ApiKey, Project.name).join(Project, Project.id == ApiKey.project_id)
    if project_name is not None:
        query = query.where(Project.name == project_name.strip())
    rows = session.execute(query.order_by(ApiKey.created_at, ApiKey.id)).all()
    return [KeyInfo(row.id, project, row.name, row.created_at, shown_prefix(row), row.revoked_at)
            for row, project in rows]


def revoke_key(session: Session, key_id: str, now: Optional[float] = None) -> tuple[ApiKey, bool]:
    """Revoke the key (NotFound for an unknown id); returns the row and whether it was revoked
    now (False: it already was, and keeps its first revocation time)."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFound("API key", key_id, "key_id")
    if row.revoked_at is not None:
        return row, False
    row.revoked_at = time.time() if now is None else now
    session.flush()
    return row, True

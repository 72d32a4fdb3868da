"""API keys: one secret per key, stored only as its SHA-256 (keys are 256-bit random, so a
fast hash is enough: no dictionary to attack), each belonging to a project."""
from __future__ import annotations

import hashlib
import secrets
from typing import Optional

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nightshift.jobs.ids import new_id
from nightshift.jobs.projects.models import ApiKey, Project

KEY_PREFIX = "ns-"


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
                 key_prefix=secret[:8], name=name)
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


def project_for_key(session: Session, key: str) -> Optional[str]:
    """The project id the key belongs to, or None for an unknown or revoked key."""
    return session.scalar(select(ApiKey.project_id).where(ApiKey.key_hash == hash_key(key),
                                                          ApiKey.revoked_at.is_(None)))

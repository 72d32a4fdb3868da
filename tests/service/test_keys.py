"""API keys on both databases: hashed storage, lookup, idempotent bootstrap, revocation."""
from __future__ import annotations

import time

from sqlalchemy import func, select

from nightshift.jobs.projects.api_keys import create_key, ensure_key, hash_key, project_for_key
from nightshift.jobs.projects.models import ApiKey, Project
from nightshift.storage.db import session_scope


def test_create_and_look_up(any_db):
    with session_scope(any_db) as s:
        row, secret = create_key(s, "analytics", name="ci")
        other_row, other = create_key(s, "analytics")
    assert secret.startswith("ns-") and secret != other and row.project_id == other_row.project_id
    with session_scope(any_db) as s:
        assert project_for_key(s, secret) == row.project_id
        assert project_for_key(s, secret + "x") is None
        stored = s.get(ApiKey, row.id)
        assert stored.key_hash == hash_key(secret) and secret not in (stored.key_hash, stored.key_prefix)
        assert s.scalar(select(func.count()).select_from(Project).where(Project.name == "analytics")) == 1


def test_bootstrap_key_is_idempotent(any_db):
    for _ in range(3):
        with session_scope(any_db) as s:
            ensure_key(s, "default", "ns-bootstrap-secret")
    with session_scope(any_db) as s:
        assert s.scalar(select(func.count()).select_from(ApiKey)) == 1
        project_id = project_for_key(s, "ns-bootstrap-secret")
        assert s.get(Project, project_id).name == "default"


def test_revoked_key_no_longer_authenticates(any_db):
    with session_scope(any_db) as s:
        row, secret = create_key(s, "p")
    with session_scope(any_db) as s:
        s.get(ApiKey, row.id).revoked_at = time.time()
    with session_scope(any_db) as s:
        assert project_for_key(s, secret) is None

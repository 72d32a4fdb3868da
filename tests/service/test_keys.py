"""API keys on both databases: hashed storage, lookup, idempotent bootstrap, revocation."""
from __future__ import annotations

import time

import pytest
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


def test_list_shows_keys_without_secrets_and_revoke_marks_them(any_db):
    from nightshift.jobs.errors import NotFound
    from nightshift.jobs.projects.api_keys import list_keys, revoke_key

    with session_scope(any_db) as s:
        first, first_secret = create_key(s, "alpha", name="ci")
        _, other_secret = create_key(s, "beta")
        ensure_key(s, "alpha", "short-boot")   # a hand-chosen short key: no part of it is shown
    with session_scope(any_db) as s:
        keys = list_keys(s)
        alpha = list_keys(s, "alpha")
    assert [k.project for k in keys] == ["alpha", "beta", "alpha"] and [k.id for k in alpha] == [keys[0].id, keys[2].id]
    assert (keys[0].id, keys[0].name, keys[0].revoked_at) == (first.id, "ci", None)
    assert keys[0].prefix == first_secret[:6] + "…" and keys[2].prefix == ""
    for k in keys:
        assert not any(secret in repr(k) for secret in (first_secret, other_secret, "short-boot"))
    with session_scope(any_db) as s:
        row, now = revoke_key(s, first.id, now=1234.5)
    assert now and row.revoked_at == 1234.5
    with session_scope(any_db) as s:
        assert revoke_key(s, first.id, now=9999.0)[1] is False        # already revoked: kept as it was
        assert project_for_key(s, first_secret) is None and project_for_key(s, other_secret) is not None
        assert list_keys(s, "alpha")[0].revoked_at == 1234.5
    with session_scope(any_db) as s, pytest.raises(NotFound):
        revoke_key(s, "key_nope")

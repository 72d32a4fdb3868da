"""Bearer keys: unknown or missing key -> 401; another project's objects -> 404, never 403."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from sqlalchemy import update

from nightshift.jobs.projects.api_keys import hash_key
from nightshift.jobs.projects.models import ApiKey
from nightshift.storage.db import session_scope

from .api_fixtures import api_service, make_key, openai_client, project_client  # noqa: F401
from .test_api_files import jsonl


def test_missing_and_unknown_keys_are_401(api_service):  # noqa: F811
    response = httpx.get(f"{api_service.base_url}/batches")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError) as err:
        openai_client(api_service.base_url, "ns-not-a-real-key-1234567890").files.list()
    assert err.value.body["code"] == "invalid_api_key"
    assert "ns-not-a-real-key" not in err.value.body["message"]   # the key is masked


def test_revoked_key_is_401(api_service):  # noqa: F811
    key = make_key(api_service.db_url, "revoked-project")
    client = openai_client(api_service.base_url, key)
    assert list(client.files.list()) == []
    with session_scope(api_service.db_url) as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(revoked_at=time.time()))
    with pytest.raises(openai.AuthenticationError):
        client.files.list()


def test_keys_are_stored_hashed(api_service):  # noqa: F811
    key = make_key(api_service.db_url, "hashed-project")
    with session_scope(api_service.db_url) as s:
        row = s.query(ApiKey).filter(ApiKey.key_hash == hash_key(key)).one()
        assert key not in (row.key_hash, row.key_prefix, row.name or "")


def test_projects_see_only_their_own_objects(api_service):  # noqa: F811
    alice, bob = project_client(api_service), project_client(api_service)
    alice_again = openai_client(api_service.base_url, make_key(api_service.db_url, _project_name(api_service, alice)))
    f = alice.files.create(file=("a.jsonl", jsonl(2)), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id), lambda: bob.files.delete(f.id),
                 lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h"),
                 lambda: bob.batches.list(after=batch.id), lambda: bob.files.list(after=f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(bob.files.list()) == [] and list(bob.batches.list()) == []
    # a second key of the same project sees everything, and nothing was changed by bob's attempts
    assert [b.id for b in alice_again.batches.list()] == [batch.id]
    assert alice_again.batches.retrieve(batch.id).status == "validating"
    assert alice_again.files.retrieve(f.id).id == f.id


def _project_name(service, client) -> str:  # noqa: ANN001
    from nightshift.jobs.projects.models import Project

    with session_scope(service.db_url) as s:
        project_id = s.query(ApiKey.project_id).filter(ApiKey.key_hash == hash_key(client.api_key)).scalar()
        return s.get(Project, project_id).name

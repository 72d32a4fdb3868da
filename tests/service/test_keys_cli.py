"""`nightshift keys create | list | revoke` against the running API's Postgres: a listing never
shows a secret, and a revoked key is refused (401) from the very next request."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import openai
import pytest

from .api_fixtures import REPO, api_service, openai_client, service_env  # noqa: F401


def keys(service, tmp_path, *args: str) -> subprocess.CompletedProcess:  # noqa: ANN001
    env = service_env(tmp_path / "cli-home", database_url=service.db_url)
    return subprocess.run([sys.executable, "-m", "nightshift.api.cli", "keys", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_create_list_revoke_and_the_revoked_key_is_refused_at_once(api_service, tmp_path):  # noqa: F811
    project = f"cli-{uuid.uuid4().hex[:8]}"
    created = keys(api_service, tmp_path, "create", "--project", project, "--name", "laptop")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    key_id = re.search(r"key (key_\w+) of project", created.stderr).group(1)
    spare = keys(api_service, tmp_path, "create", "--project", project).stdout.strip()
    client, spare_client = openai_client(api_service.base_url, secret), openai_client(api_service.base_url, spare)
    assert list(client.files.list()) == []

    listed = keys(api_service, tmp_path, "list", "--project", project)
    assert listed.returncode == 0, listed.stderr
    header, first, second = listed.stdout.splitlines()
    assert header.split() == ["ID", "PROJECT", "NAME", "CREATED", "PREFIX", "REVOKED"]
    assert first.split()[:3] == [key_id, project, "laptop"] and first.split()[-1] == "no"
    assert f" {secret[:6]}… " in first and second.split()[2] == "-"       # unnamed
    as_json = json.loads(keys(api_service, tmp_path, "list", "--project", project, "--json").stdout)
    assert [(k["id"], k["name"], k["revoked_at"]) for k in as_json] == [(key_id, "laptop", None),
                                                                        (as_json[1]["id"], None, None)]
    everything = keys(api_service, tmp_path, "list")
    assert key_id in everything.stdout
    for run in (listed, everything):
        for out in (run.stdout, run.stderr):
            assert secret not in out and spare not in out and secret[:10] not in out

    revoked = keys(api_service, tmp_path, "revoke", key_id)
    assert revoked.returncode == 0 and revoked.stdout.startswith(f"revoked {key_id} at ")
    with pytest.raises(openai.AuthenticationError) as err:     # the very next request
        client.files.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert list(spare_client.files.list()) == []                # the project's other key still works
    again = keys(api_service, tmp_path, "revoke", key_id)
    assert again.returncode == 0 and "already revoked" in again.stdout
    first = keys(api_service, tmp_path, "list", "--project", project).stdout.splitlines()[1]
    assert first.split()[0] == key_id and first.split()[-1] != "no"
    unknown = keys(api_service, tmp_path, "revoke", "key_doesnotexist")
    assert unknown.returncode == 1 and "no API key with id 'key_doesnotexist'" in unknown.stderr

"""The console over plain HTTP against the running API (uvicorn subprocess on Postgres and moto's
S3, no workers): login and its cookie, CSRF, logout, a revoked key, tenancy (another project's
batch is 404 on every page, poll, download and action), the pages' figures for a batch whose
results were written the way an engine worker writes them, filters and pagination, schedules
on/off, costs and health. The browser and the real engine: test_console_browser.py."""
from __future__ import annotations

import hashlib
import html
import re
import time
import uuid

import httpx
import pytest

from nightshift.jobs.batches.leases import RequestResult, claim_shard, complete_shard, write_results
from nightshift.jobs.batches.models import Batch, BatchStatus, Request
from nightshift.jobs.files.models import File
from nightshift.jobs.projects.api_keys import key_for_secret, project_for_key, revoke_key
from nightshift.jobs.projects.models import ConsoleSession
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.workers.finalize import finalize_batch

from .api_fixtures import api_service, make_key  # noqa: F401
from .factories import make_running_batch
from .test_api_costs_schedules import _s3_store, schedule_body
from .test_api_files import jsonl

LOGIN_TOKEN = re.compile(r'name="login_token" value="([^"]+)"')
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def root(service) -> str:  # noqa: ANN001
    return service.base_url.removesuffix("/v1")


def api(service, key: str) -> httpx.Client:  # noqa: ANN001
    return httpx.Client(base_url=service.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def new_key(service) -> str:  # noqa: ANN001
    return make_key(service.db_url, f"console-{uuid.uuid4().hex[:8]}")


def login(service, key: str, **headers: str) -> tuple[httpx.Client, httpx.Response]:  # noqa: ANN001
    """A browser-like client logged in with ``key``, and the login's answer."""
    browser = httpx.Client(base_url=root(service), timeout=30, headers=headers)
    form = browser.get("/console/login")
    assert form.status_code == 200
    answer = browser.post("/console/login", data={"api_key": key, "login_token": LOGIN_TOKEN.search(form.text)[1]})
    return browser, answer


def logged_in(service, key: str) -> httpx.Client:  # noqa: ANN001
    browser, answer = login(service, key)
    assert answer.status_code == 303 and answer.headers["location"] == "/console", answer.text
    return browser


def csrf_of(page: httpx.Response) -> str:
    return CSRF.search(page.text)[1]


def new_batch(service, key: str, lines: int = 2) -> str:  # noqa: ANN001
    client = api(service, key)
    file_id = client.post("/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", jsonl(lines))}).json()["id"]
    return client.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                         "completion_window": "24h"}).json()["id"]


def finished_batch(service, key: str) -> str:  # noqa: ANN001
    """An ended batch of the key's project, its results written under shard leases as an engine
    worker writes them (3 answered on cpu, line 4 refused by the model with a 400), then finalized."""
    store = _s3_store(service)
    batch_id, shard_ids = make_running_batch(service.db_url, store, 4, 2)
    with session_scope(service.db_url) as s:
        project_id = project_for_key(s, key)
        batch = s.get(Batch, batch_id)
        batch.project_id = s.get(File, batch.input_file_id).project_id = project_id
    with session_scope(service.db_url) as s:
        requests = {r.line: r.id for r in s.query(Request).filter(Request.batch_id == batch_id)}
    for shard_id in shard_ids:
        with session_scope(service.db_url) as s:
            lease = claim_shard(s, shard_id, "gpu-1@test", 60, device="cpu")
            mine = [line for line, rid in requests.items() if s.get(Request, rid).shard_id == shard_id]
            results = [RequestResult(requests[line], "completed", 200, {"choices": [{"message": {"content": "ok"}}]},
                                     prompt_tokens=100, cached_tokens=40, completion_tokens=10, engine_seconds=0.5) if line != 4 else
                       RequestResult(requests[line], "failed", 400, {"error": {"code": "invalid_value",
                                                                               "message": "temperature is too high"}},
                                     prompt_tokens=100, engine_seconds=0.25)
                       for line in mine]
            assert write_results(s, lease, results, 60, device="cpu") == len(mine)
            assert complete_shard(s, lease)
    with session_scope(service.db_url) as s:
        s.get(Batch, batch_id).status = BatchStatus.FINALIZING
    assert finalize_batch(batch_id, settings=Settings(database_url=service.db_url), store=store).status == "completed"
    return batch_id


def test_login_exchanges_the_key_for_an_httponly_strict_session_cookie(api_service):  # noqa: F811
    key = new_key(api_service)
    form = httpx.get(f"{root(api_service)}/console/login")
    assert form.status_code == 200 and 'type="password"' in form.text and 'autocomplete="off"' in form.text
    assert "script-src 'self'" in form.headers["content-security-policy"]
    browser, answer = login(api_service, key)
    assert answer.status_code == 303 and answer.headers["location"] == "/console"
    cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith("nightshift_console="))
    token = cookie.split(";")[0].split("=", 1)[1]
    flags = [part.strip().lower() for part in cookie.split(";")[1:]]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console" in flags
    assert "secure" not in flags                                      # plain HTTP here
    assert key not in " ".join(answer.headers.get_list("set-cookie")) and token != key
    with session_scope(api_service.db_url) as s:                      # only the token's hash is kept
        row = s.get(ConsoleSession, hashlib.sha256(token.encode()).hexdigest())
        assert row is not None and row.api_key_id == key_for_secret(s, key).id
        assert key not in (row.token_hash, row.csrf_token)
    page = browser.get("/console")
    assert page.status_code == 200 and "No batches" in page.text and "Log out" in page.text
    assert page.headers["cache-control"] == "no-store"


def test_the_cookie_is_secure_when_served_over_https(api_service):  # noqa: F811
    # uvicorn trusts X-Forwarded-Proto from 127.0.0.1 (a TLS-terminating proxy on the host). Both
    # cookies are Secure then, so this plain-HTTP client sends the login form's back by hand.
    https = {"x-forwarded-proto": "https"}
    form = httpx.get(f"{root(api_service)}/console/login", headers=https)
    login_cookie = form.headers["set-cookie"]
    assert "secure" in [part.strip().lower() for part in login_cookie.split(";")]
    answer = httpx.post(f"{root(api_service)}/console/login", headers={**https, "cookie": login_cookie.split(";")[0]},
                        data={"api_key": new_key(api_service), "login_token": LOGIN_TOKEN.search(form.text)[1]})
    assert answer.status_code == 303
    cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith("nightshift_console="))
    assert "secure" in [part.strip().lower() for part in cookie.split(";")]


def test_login_refuses_bad_keys_and_forms_that_did_not_come_from_the_console(api_service):  # noqa: F811
    key = new_key(api_service)
    browser, answer = login(api_service, "ns-not-a-key")
    assert answer.status_code == 401 and "not valid" in answer.text and "nightshift_console=" not in \
        " ".join(c for c in answer.headers.get_list("set-cookie") if not c.startswith("nightshift_console_login"))
    _, empty = login(api_service, "  ")
    assert empty.status_code == 400 and "Enter an API key" in empty.text
    # a form posted from elsewhere carries no login cookie (SameSite=Strict): refused, no session
    forged = httpx.post(f"{root(api_service)}/console/login", data={"api_key": key, "login_token": "x"})
    assert forged.status_code == 403 and "nightshift_console=" not in forged.headers.get("set-cookie", "")
    with session_scope(api_service.db_url) as s:
        revoke_key(s, key_for_secret(s, key).id)
    _, revoked = login(api_service, key)
    assert revoked.status_code == 401


def test_actions_without_the_sessions_csrf_token_are_refused(api_service):  # noqa: F811
    key = new_key(api_service)
    batch_id = new_batch(api_service, key)
    browser = logged_in(api_service, key)
    page = browser.get(f"/console/batches/{batch_id}")
    assert page.status_code == 200 and "Cancel batch" in page.text
    token = csrf_of(page)
    for data, headers in (({}, {}), ({"csrf_token": "forged"}, {}), ({}, {"x-csrf-token": "forged"}),
                          ({"csrf_token": csrf_of(logged_in(api_service, key).get("/console"))}, {})):  # another session's
        refused = browser.post(f"/console/batches/{batch_id}/cancel", data=data, headers=headers)
        assert refused.status_code == 403 and "CSRF" in refused.text
    assert api(api_service, key).get(f"/batches/{batch_id}").json()["status"] == "validating"
    done = browser.post(f"/console/batches/{batch_id}/cancel", data={"csrf_token": token})
    assert done.status_code == 303 and done.headers["location"] == f"/console/batches/{batch_id}"
    assert api(api_service, key).get(f"/batches/{batch_id}").json()["status"] == "cancelling"
    assert browser.post("/console/logout", data={}).status_code == 403         # logout too


def test_logout_ends_the_session_on_the_server(api_service):  # noqa: F811
    key = new_key(api_service)
    browser = logged_in(api_service, key)
    token = browser.cookies["nightshift_console"]
    out = browser.post("/console/logout", data={"csrf_token": csrf_of(browser.get("/console"))})
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert 'nightshift_console=""' in out.headers["set-cookie"] and "Max-Age=0" in out.headers["set-cookie"]
    with session_scope(api_service.db_url) as s:
        assert s.get(ConsoleSession, hashlib.sha256(token.encode()).hexdigest()) is None
    replayed = httpx.Client(base_url=root(api_service), cookies={"nightshift_console": token})
    assert replayed.get("/console").status_code == 303
    assert replayed.get("/console").headers["location"] == "/console/login"
    assert replayed.get("/console/api/progress", params={"ids": "batch_x"}).status_code == 401


def test_a_revoked_keys_session_ends_at_its_next_request(api_service):  # noqa: F811
    key = new_key(api_service)
    batch_id = new_batch(api_service, key)
    browser = logged_in(api_service, key)
    token_hash = hashlib.sha256(browser.cookies["nightshift_console"].encode()).hexdigest()
    assert browser.get("/console/api/progress", params={"ids": batch_id}).status_code == 200
    with session_scope(api_service.db_url) as s:
        revoke_key(s, key_for_secret(s, key).id)
    poll = browser.get("/console/api/progress", params={"ids": batch_id})
    assert poll.status_code == 401 and poll.json()["error"]["login"] == "/console/login"
    assert browser.get("/console").status_code == 303
    with session_scope(api_service.db_url) as s:       # the ended session's row is gone too
        assert s.get(ConsoleSession, token_hash) is None


def test_another_projects_batch_is_404_everywhere(api_service):  # noqa: F811
    owner, stranger_key = new_key(api_service), new_key(api_service)
    batch_id = finished_batch(api_service, owner)
    mine = logged_in(api_service, owner).get(f"/console/batches/{batch_id}")
    output_link = re.search(r'href="/console/files/([^"/]+)/content"', mine.text)[1]
    stranger = logged_in(api_service, stranger_key)
    page = stranger.get("/console")
    assert page.status_code == 200 and batch_id not in page.text and "No batches" in page.text
    token = csrf_of(page)
    for answer in (stranger.get(f"/console/batches/{batch_id}"),
                   stranger.get(f"/console/files/{output_link}/content"),
                   stranger.post(f"/console/batches/{batch_id}/cancel", data={"csrf_token": token}),
                   stranger.post(f"/console/batches/{batch_id}/retry", data={"csrf_token": token})):
        assert answer.status_code == 404, answer.text
    poll = stranger.get("/console/api/progress", params={"ids": batch_id})
    assert poll.status_code == 404 and poll.json()["error"]["message"] == f"No batch found with id '{batch_id}'."
    assert "Retry failed lines" in mine.text                         # the owner sees it whole


def test_a_finished_batch_page_shows_its_figures_files_errors_and_retries(api_service):  # noqa: F811
    key = new_key(api_service)
    batch_id = finished_batch(api_service, key)
    browser = logged_in(api_service, key)
    page = browser.get(f"/console/batches/{batch_id}")
    assert page.status_code == 200
    text = page.text
    assert 'data-status="completed"' in text and "4 / 4" in text
    assert 'data-field="text.completed">3<' in text and 'data-field="text.failed">1<' in text
    assert 'data-field="text.input_tokens">400<' in text and "30.0%" in text      # cached share: 120 of 400
    report = api(api_service, key).get(f"/batches/{batch_id}/cost").json()
    assert report["cost"]["usd"] == pytest.approx(1.75 * 0.10 / 3600)
    cost_text = re.search(r'data-field="text.cost">([^<]+)<', text)[1]
    assert cost_text == "$0.000049"                                    # shard sums give the report's figure
    assert "cost.json, written when the batch ended" in text and "<svg" in text
    for label in ("Input", "Output", "Errors", "Cost report (JSON)", "Cost per request (CSV)"):
        assert f"<li>{label}:" in text
    assert "temperature is too high" in text and "invalid_value" in text           # the first error lines
    assert "completed" in text and "created" in text                              # the timeline
    links = dict(re.findall(r'<li>([^:<]+):\s*<a href="(/console/files/[^"]+/content)"', text))
    errors = browser.get(links["Errors"])
    assert errors.status_code == 200, (links, errors.text)
    assert b"temperature is too high" in errors.content
    assert errors.headers["content-disposition"].startswith("attachment;")
    assert browser.get(links["Cost report (JSON)"]).json()["cost"] == report["cost"]

    retried = browser.post(f"/console/batches/{batch_id}/retry", data={"csrf_token": csrf_of(page)})
    assert retried.status_code == 303
    new_id = retried.headers["location"].rsplit("/", 1)[1]
    new_batch_doc = api(api_service, key).get(f"/batches/{new_id}").json()
    assert new_batch_doc["metadata"] == {"retry_of": batch_id}
    new_page = browser.get(retried.headers["location"])
    assert f'retry of <a href="/console/batches/{batch_id}">' in new_page.text
    assert f'retried by <a href="/console/batches/{new_id}">' in browser.get(f"/console/batches/{batch_id}").text
    again = browser.post(f"/console/batches/{new_id}/retry", data={"csrf_token": csrf_of(page)})
    assert again.status_code == 409 and "only an ended batch" in again.text           # it has not ended


def test_batches_list_filters_pages_and_live_poll(api_service):  # noqa: F811
    key = new_key(api_service)
    ids = [new_batch(api_service, key) for _ in range(3)]                     # newest last
    api(api_service, key).post(f"/batches/{ids[0]}/cancel")
    browser = logged_in(api_service, key)
    everything = browser.get("/console")
    assert all(batch_id in everything.text for batch_id in ids)
    assert 'data-live="/console/api/progress"' in everything.text
    cancelling = browser.get("/console", params={"status": "cancelling"})
    assert ids[0] in cancelling.text and ids[1] not in cancelling.text
    first = browser.get("/console", params={"limit": 2})
    assert ids[2] in first.text and ids[1] in first.text and ids[0] not in first.text
    older = re.search(r'href="([^"]+)" rel="next"', first.text)[1].replace("&amp;", "&")
    assert older == f"/console?limit=2&after={ids[1]}"
    second = browser.get(older)
    assert ids[0] in second.text and ids[2] not in second.text and 'rel="next"' not in second.text
    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert ids[0] in browser.get("/console", params={"from": today, "to": today}).text
    assert "No batches match" in browser.get("/console", params={"to": "2020-01-01"}).text
    for params, said in (({"status": "running"}, "Invalid status 'running'"),
                         ({"from": "yesterday"}, "'from' must be a date"),
                         ({"from": today, "to": "2020-01-01"}, "'from' must not be after 'to'"),
                         ({"limit": 0}, "limit")):
        bad = browser.get("/console", params=params)
        assert bad.status_code == 400 and said in html.unescape(bad.text), bad.text

    poll = browser.get("/console/api/progress", params={"ids": ",".join(ids)})
    assert poll.status_code == 200 and list(poll.json()["batches"]) == ids
    one = poll.json()["batches"][ids[0]]
    assert one["status"] == "cancelling" and one["terminal"] is False and one["text"]["cost"] == "$0.000000"
    assert browser.get("/console/api/progress", params={"ids": ""}).status_code == 400
    assert browser.get("/console/api/progress").status_code == 400
    too_many = browser.get("/console/api/progress", params={"ids": ",".join(["batch_x"] * 101)})
    assert too_many.status_code == 400 and "At most 100" in too_many.json()["error"]["message"]


def test_schedules_page_and_enable_disable(api_service):  # noqa: F811
    key = new_key(api_service)
    created = api(api_service, key).post("/schedules", json=schedule_body(name="nightly-console")).json()
    browser = logged_in(api_service, key)
    page = browser.get("/console/schedules")
    assert page.status_code == 200 and "nightly-console" in page.text and "0 2 * * *" in page.text
    assert "next due" in page.text and "No runs yet" in page.text
    off = browser.post(f"/console/schedules/{created['id']}/pause", data={"csrf_token": csrf_of(page)})
    assert off.status_code == 303
    assert api(api_service, key).get(f"/schedules/{created['id']}").json()["status"] == "paused"
    page = browser.get("/console/schedules")
    assert "(paused)" in page.text and ">Enable<" in page.text
    assert browser.post(f"/console/schedules/{created['id']}/resume", data={"csrf_token": csrf_of(page)}).status_code == 303
    assert api(api_service, key).get(f"/schedules/{created['id']}").json()["status"] == "active"
    stranger = logged_in(api_service, new_key(api_service))
    assert "nightly-console" not in stranger.get("/console/schedules").text
    assert stranger.post(f"/console/schedules/{created['id']}/pause",
                         data={"csrf_token": csrf_of(stranger.get("/console"))}).status_code == 404


def test_costs_and_health_pages(api_service):  # noqa: F811
    key = new_key(api_service)
    batch_id = finished_batch(api_service, key)
    browser = logged_in(api_service, key)
    costs = browser.get("/console/costs", params={"days": 7})
    assert costs.status_code == 200 and "<svg" in costs.text and time.strftime("%Y-%m-%d", time.gmtime()) in costs.text
    report = api(api_service, key).get(f"/batches/{batch_id}/cost").json()
    assert re.search(r'data-testid="total-cost">([^<]+)<', costs.text)[1] == "$0.000049" == \
        f"${report['cost']['usd']:,.6f}"
    assert browser.get("/console/costs", params={"days": 5}).status_code == 400
    health = browser.get("/console/health")
    assert health.status_code == 200 and "Engine workers seen" in health.text and "gpu" in health.text
    live = browser.get("/console/api/health").json()
    assert set(live["queues"]) == {"gpu", "cpu", "upkeep"} and "completion" in live["throughput"]
    assert browser.get("/console/nothing-here").status_code == 404
    assert httpx.get(f"{root(api_service)}/console/static/console.js").status_code == 200


def test_a_console_session_is_rate_limited_like_a_key_apart_from_the_api_keys(pg_url, s3_server, tmp_path):
    """Its own bucket (not its key's): a page hammering its poll gets 429 while the API key it
    logged in with is still answered."""
    from .api_fixtures import Service, free_port, new_bucket, s3_env, service_env

    env = service_env(tmp_path, database_url=pg_url, rate_limit_key_rps=1, rate_limit_key_burst=3,
                      rate_limit_hold_seconds=0, **s3_env(s3_server, new_bucket(s3_server)))
    service = Service(env, tmp_path)
    try:
        service.base_url, service.db_url = service.start_api(free_port()), pg_url
        key = new_key(service)
        browser = logged_in(service, key)
        answers = [browser.get("/console/api/progress", params={"ids": "batch_x"}) for _ in range(6)]
        assert [a.status_code for a in answers[:3]] == [404] * 3                 # the burst: answered
        limited = answers[-1]
        assert limited.status_code == 429 and "this console session" in limited.json()["error"]["message"]
        assert int(limited.headers["retry-after"]) >= 1
        assert api(service, key).get("/batches").status_code == 200             # the key's own bucket is whole
        assert httpx.get(f"{root(service)}/console/static/console.css").status_code == 200   # assets are not limited
    finally:
        service.stop()

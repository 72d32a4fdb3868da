"""Webhooks against a real local HTTP receiver: endpoints managed through the API, events
recorded with the state change, signed deliveries retried with backoff until the receiver says
yes (a receiver that fails twice, then succeeds), every attempt recorded, and an ended batch of
the real service announced to its project's endpoint."""
from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from nightshift.jobs.webhooks.delivery import retry_delay, sign, verify
from nightshift.jobs.webhooks.events import record_event
from nightshift.jobs.webhooks.models import WebhookAttempt, WebhookDelivery
from nightshift.jobs.webhooks.service import create_endpoint
from nightshift.storage.db import session_scope
from nightshift.workers.webhooks import deliver_due_webhooks

from .api_fixtures import Service, api_service, free_port, make_key, service_env, wait_http  # noqa: F401
from .factories import make_project


class Receiver:
    """An HTTP server on 127.0.0.1 that answers the first `failures` posts with 500, then 204,
    and keeps every request (headers and body)."""

    def __init__(self, failures: int = 0):
        self.failures = failures
        self.received: list[tuple[dict, bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                status = 500 if len(receiver.received) < receiver.failures else 204
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):  # noqa: ANN002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver():
    r = Receiver(failures=2)
    yield r
    r.close()


def test_signatures_verify_and_backoff_doubles():
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"type": "batch.completed"}'
    headers = {"webhook-id": "evt_1", "webhook-timestamp": "1700000000",
               "webhook-signature": sign(secret, "evt_1", 1700000000, body)}
    assert verify(secret, headers, body, now=1700000010)
    assert not verify(secret, headers, body + b" ", now=1700000010)                 # body changed
    assert not verify(secret, headers, body, now=1700000000 + 3600)                 # replayed much later
    assert not verify(secret, {**headers, "webhook-id": "evt_2"}, body, now=1700000010)
    assert [retry_delay(n, 10) for n in (1, 2, 3, 4)] == [10, 20, 40, 80] and retry_delay(20, 10) == 3600


def test_a_receiver_that_fails_twice_gets_the_event_on_the_third_attempt(any_db, settings_env, receiver):
    settings = settings_env(database_url=any_db, webhook_retry_base_seconds=0.2, webhook_timeout_seconds=5)
    pid = make_project(any_db)
    with session_scope(any_db) as s:
        endpoint = create_endpoint(s, pid, url=receiver.url, events=["batch.completed"])
        secret = endpoint.secret
        assert record_event(s, pid, "batch.completed", "batch_x", {"id": "batch_x", "status": "completed"}) == 1
        assert record_event(s, pid, "batch.completed", "batch_x", {"id": "batch_x"}) == 0   # recorded twice: one
        assert record_event(s, pid, "batch.failed", "batch_y", {"id": "batch_y"}) == 0      # not subscribed
    deadline = time.monotonic() + 30
    states: list[dict] = []
    while time.monotonic() < deadline and len(receiver.received) < 3:
        states.append(deliver_due_webhooks(settings))
        time.sleep(0.05)
    assert [status for _, _, status in receiver.received] == [500, 500, 204]
    ids = {headers["webhook-id"] for headers, _, _ in receiver.received}
    assert len(ids) == 1                                                # the idempotency key of all three
    for headers, body, _ in receiver.received:
        assert verify(secret, headers, body)
        event = json.loads(body)
        assert event["type"] == "batch.completed" and event["data"]["status"] == "completed"
    with session_scope(any_db) as s:
        (delivery,) = s.query(WebhookDelivery).all()
        attempts = s.query(WebhookAttempt).order_by(WebhookAttempt.attempt).all()
        assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 3, 204)
        assert [(a.attempt, a.status_code) for a in attempts] == [(1, 500), (2, 500), (3, 204)]
        # the second try waited the base delay, the third twice that
        gaps = [attempts[i + 1].started_at - attempts[i].started_at for i in range(2)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4


def test_endpoints_through_the_api(api_service):  # noqa: F811
    key = make_key(api_service.db_url, "hooks")
    other = make_key(api_service.db_url, "hooks-other")
    http = httpx.Client(base_url=api_service.base_url, headers={"Authorization": f"Bearer {key}"})
    created = http.post("/webhooks", json={"url": "https://example.com/hook", "events": ["batch.failed"]}).json()
    assert created["id"].startswith("wh_") and created["secret"].startswith("whsec_")
    assert created["events"] == ["batch.failed"] and created["enabled"] is True
    got = http.get(f"/webhooks/{created['id']}").json()
    assert got["secret"] is None and got["url"] == "https://example.com/hook"       # shown once
    assert [w["id"] for w in http.get("/webhooks").json()["data"]] == [created["id"]]
    updated = http.post(f"/webhooks/{created['id']}", json={"enabled": False, "events": ["batch.completed"]}).json()
    assert (updated["enabled"], updated["events"]) == (False, ["batch.completed"])
    bad = http.post("/webhooks", json={"url": "ftp://x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    bad = http.post("/webhooks", json={"url": "https://x.example", "events": ["batch.exploded"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "events"
    stranger = httpx.get(f"{api_service.base_url}/webhooks/{created['id']}", headers={"Authorization": f"Bearer {other}"})
    assert stranger.status_code == 404
    assert http.get(f"/webhooks/{created['id']}/deliveries").json()["data"] == []
    assert http.delete(f"/webhooks/{created['id']}").json() == {"id": created["id"],
                                                                 "object": "webhook_endpoint.deleted", "deleted": True}
    assert http.get(f"/webhooks/{created['id']}").status_code == 404


@pytest.mark.slow
def test_an_ended_batch_is_announced_to_its_project(tmp_path, receiver):
    from .test_cli_embedded import small_input

    receiver.failures = 1
    input_path, expected = small_input(tmp_path / "input.jsonl", n=2)
    home = tmp_path / "home"
    port = free_port()
    service = Service(service_env(home, port=port, webhook_tick_seconds=0.5, webhook_retry_base_seconds=0.5),
                      tmp_path)
    try:
        server = service.start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                         "--log-level", "warning"])
        wait_http(f"http://127.0.0.1:{port}/health", server, timeout=120)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=30,
                            headers={"Authorization": f"Bearer {(home / 'api_key').read_text().strip()}"})
        endpoint = http.post("/webhooks", json={"url": receiver.url}).json()
        file_id = http.post("/files", data={"purpose": "batch"},
                            files={"file": ("in.jsonl", input_path.read_bytes())}).json()["id"]
        batch = http.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"}).json()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(status == 204 for _, _, status in receiver.received):
            time.sleep(0.5)
        deliveries = http.get(f"/webhooks/{endpoint['id']}/deliveries").json()["data"]
    finally:
        service.stop()
    headers, body, _ = receiver.received[-1]
    event = json.loads(body)
    assert verify(endpoint["secret"], headers, body)
    assert event["type"] == "batch.completed" and event["data"]["id"] == batch["id"]
    assert event["data"]["status"] == "completed" and event["data"]["request_counts"]["completed"] == len(expected)
    assert [(d["status"], [a["status_code"] for a in d["attempts"]]) for d in deliveries] == [("delivered", [500, 204])]


def test_a_schedule_run_that_cannot_start_is_an_event(any_db, settings_env, tmp_path):
    """A run whose source is gone fails at start; the project's endpoint gets schedule_run.failed
    with the run (recorded in the transaction that failed it)."""
    from datetime import datetime, timezone

    from nightshift.jobs.schedules.service import create_schedule
    from nightshift.storage.objectstore import get_object_store
    from nightshift.workers.schedule_runs import fire_due_schedules, start_schedule_run

    from nightshift.jobs.files.models import File

    from .factories import make_input_file

    settings = settings_env(database_url=any_db, storage_dir=tmp_path / "o")
    store = get_object_store()
    pid = make_project(any_db)
    file_id = make_input_file(any_db, store, pid, [{"custom_id": "a"}])
    now = datetime(2026, 11, 21, 1, 0, tzinfo=timezone.utc).timestamp()
    with session_scope(any_db) as s:
        create_endpoint(s, pid, url="https://hooks.example/x", events=["schedule_run.failed"])
        create_schedule(s, project_id=pid, name="from-a-file", cron="0 2 * * *", timezone_name="UTC",
                        endpoint="/v1/chat/completions", model="default",
                        source={"type": "file", "file_id": file_id}, prompt_template=None, now=now)
    store.delete(f"files/{file_id}")                # its file is gone by the time the run starts
    (run_id,) = fire_due_schedules(settings, now + 3600)
    assert start_schedule_run(settings, store, run_id) is None
    with session_scope(any_db) as s:
        (delivery,) = s.query(WebhookDelivery).all()
        assert delivery.event_type == "schedule_run.failed"
        assert delivery.payload["data"]["id"] == run_id and delivery.payload["data"]["status"] == "failed"
        assert delivery.payload["data"]["error"]

"""The API while Postgres is away, on a Postgres cluster of the test's own (``bench.services.
PostgresServer``: initdb + pg_ctl on a temporary folder and a free port; the machine's server is
never touched) and the API as a uvicorn subprocess on it. Clients poll a batch, list batches,
upload files and create batches through each fault: every answer is a 200 or a 503 with
``Retry-After`` and OpenAI's error body (never a 500, never a hang past the connect timeout), and
the API answers 200 again within 2 s of the database's return.

Faults: a crash (``pg_ctl stop -m immediate``, down a few seconds, crash recovery at the start),
a fast restart (``pg_ctl restart -m fast``, which the openai client rides through on its own
retries), and a server that accepts connections but never answers (the postmaster stopped with
SIGSTOP after the API's connections were ended: a host gone from the network looks the same),
where opening a connection gives up after ``db_connect_timeout_seconds``."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import pytest
import sqlalchemy as sa

from bench.services import PostgresServer

from .api_fixtures import Service, free_port, openai_client, service_env
from .test_api_files import jsonl

pytestmark = pytest.mark.slow

KEY = "ns-outage-test-key-0123456789"
CONNECT_TIMEOUT = 2.0          # libpq's least
RECOVERY_SECONDS = 2.0         # 200 again within this long of the database's return
SLACK = 1.5                    # scheduling on a shared 2-core machine


@dataclass
class Answer:
    sent: float
    seconds: float
    kind: str
    status: object              # an HTTP status, or the exception's name
    retry_after: Optional[str] = None
    error: Optional[dict] = None


@dataclass
class Outage:
    """The fault's window, on the same clock as the answers."""

    down: float = 0.0
    up: float = 0.0


@dataclass
class Polling:
    base_url: str
    batch_id: str
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def _requests(self, http: httpx.Client, i: int):  # noqa: ANN202
        kinds = [("GET batch", lambda: http.get(f"/batches/{self.batch_id}")),
                 ("GET batches", lambda: http.get("/batches", params={"limit": 5})),
                 ("POST files", lambda: http.post("/files", data={"purpose": "batch"},
                                                  files={"file": ("in.jsonl", jsonl(2))})),
                 ("POST batches", lambda: http.post("/batches", json={"input_file_id": "file-missing",
                                                                      "endpoint": "/v1/chat/completions",
                                                                      "completion_window": "24h"})),
                 ("GET health", lambda: http.get(self.base_url.removesuffix("/v1") + "/health"))]
        return kinds[i % len(kinds)]

    def _client(self, worker: int) -> None:
        with httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            i = worker
            while not self.stop.is_set():
                kind, call = self._requests(http, i)
                i += 1
                sent = time.monotonic()
                try:
                    response = call()
                    status, retry_after = response.status_code, response.headers.get("retry-after")
                    error = response.json().get("error") if response.status_code >= 400 else None
                except (httpx.HTTPError, ValueError) as exc:
                    status, retry_after, error = type(exc).__name__, None, None
                self.answers.append(Answer(sent, time.monotonic() - sent, kind, status, retry_after, error))
                time.sleep(0.1)

    @contextlib.contextmanager
    def running(self, clients: int = 5):  # noqa: ANN201
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(60)


def check(answers: list[Answer], outage: Outage, slowest: float) -> list[Answer]:
    """The promises over one fault; returns the 503s answered during it."""
    expected = {"GET batch": 200, "GET batches": 200, "POST files": 200, "POST batches": 404, "GET health": 200}
    wrong = [a for a in answers if a.status not in (expected[a.kind], 503)]
    assert wrong == [], wrong[:5]
    unavailable = [a for a in answers if a.status == 503]
    assert unavailable, "the fault did not show: no 503 while the database was away"
    for answer in unavailable:
        assert answer.retry_after and int(answer.retry_after) >= 1, answer
        assert answer.error is not None and answer.error["type"] == "server_error", answer
        assert answer.error["code"] in ("service_unavailable", "server_overloaded"), answer
        assert set(answer.error) == {"message", "type", "param", "code"}, answer
    assert max(a.seconds for a in answers) < slowest, sorted(answers, key=lambda a: -a.seconds)[:3]
    # 200 again within RECOVERY_SECONDS of the return: a request sent after then is not refused,
    # and one answered 200 by then
    late = [a for a in unavailable if a.sent > outage.up + RECOVERY_SECONDS]
    assert late == [], late[:5]
    assert any(a.status == 200 and a.sent + a.seconds <= outage.up + RECOVERY_SECONDS
               for a in answers if a.sent >= outage.up), "no 200 within 2 s of the database's return"
    return unavailable


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Postgres cluster of the module's own with a migrated database, and the API on it."""
    from nightshift.migrations import upgrade_head

    pg = PostgresServer().init()
    service: Optional[Service] = None
    try:
        admin = sa.create_engine(pg.admin_url(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.exec_driver_sql('CREATE DATABASE "nightshift"')
        url = pg.admin_url("nightshift")
        upgrade_head(url)
        home = tmp_path_factory.mktemp("outage-home")
        service = Service(service_env(home, database_url=url, bootstrap_key=KEY,
                                      db_connect_timeout_seconds=CONNECT_TIMEOUT), home)
        service.base_url = service.start_api(free_port())
        service.pg, service.admin = pg, admin
        client = openai_client(service.base_url, KEY)
        file = client.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
        service.batch_id = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id
        yield service
    finally:
        if service is not None:
            service.stop()
        _resume(pg)
        pg.remove()


def _postmaster(pg: PostgresServer) -> int:
    return int((pg.data / "postmaster.pid").read_text().split()[0])


def _resume(pg: PostgresServer) -> None:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        os.kill(_postmaster(pg), signal.SIGCONT)


def _polling(cluster) -> Polling:  # noqa: ANN001
    return Polling(cluster.base_url, cluster.batch_id)


def test_a_crash_answers_503_then_200_within_2s_of_the_return(cluster):
    outage = Outage()
    with _polling(cluster).running() as polling:
        time.sleep(0.5)
        outage.down = time.monotonic()
        cluster.pg.stop("immediate")                  # a crash: no shutdown checkpoint
        time.sleep(3.0)
        cluster.pg.start()                            # returns once it accepts connections
        outage.up = time.monotonic()
        time.sleep(RECOVERY_SECONDS + 1.0)
    # a refused connection fails at once: nothing waits longer than a database slot's queue
    unavailable = check(polling.answers, outage, slowest=2.0 + SLACK)
    assert all(outage.down <= a.sent + a.seconds for a in unavailable)
    assert "database unavailable, answering 503 with Retry-After" in cluster.log("api")
    assert "Traceback" not in cluster.log("api")


def test_a_fast_restart_is_ridden_through_by_the_openai_client(cluster):
    outage = Outage()
    client = openai_client(cluster.base_url, KEY).with_options(max_retries=5)
    seen: list[object] = []

    def retrieve() -> None:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            seen.append(client.batches.retrieve(cluster.batch_id).status)   # raises if its retries run out
            time.sleep(0.05)

    with _polling(cluster).running() as polling:
        rider = threading.Thread(target=retrieve)
        rider.start()
        time.sleep(0.5)
        outage.down = time.monotonic()
        cluster.pg.restart()
        outage.up = time.monotonic()
        rider.join(60)
        time.sleep(max(0.0, outage.up + RECOVERY_SECONDS + 0.5 - time.monotonic()))
    check(polling.answers, outage, slowest=2.0 + SLACK)
    assert seen and set(seen) <= {"validating", "failed", "in_progress"}, seen


def test_a_server_that_answers_nothing_is_a_503_within_the_connect_timeout(cluster):
    """The postmaster stopped (SIGSTOP): the kernel still accepts the connection, nothing answers
    it. The API's connections are ended first, so every request needs a new one."""
    outage = Outage()
    pg = cluster.pg
    with _polling(cluster).running() as polling:
        time.sleep(0.5)
        with cluster.admin.connect() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = 'nightshift' AND pid <> pg_backend_pid()")
        outage.down = time.monotonic()
        os.kill(_postmaster(pg), signal.SIGSTOP)
        try:
            time.sleep(CONNECT_TIMEOUT * 2 + 1.0)
        finally:
            os.kill(_postmaster(pg), signal.SIGCONT)
        outage.up = time.monotonic()
        time.sleep(RECOVERY_SECONDS + 1.0)
    # a request may wait for a database slot (api_queue_seconds, 2 s) and then for the connect timeout
    check(polling.answers, outage, slowest=2.0 + CONNECT_TIMEOUT + SLACK)
    timed_out = [a for a in polling.answers if a.status == 503 and a.seconds >= CONNECT_TIMEOUT - 0.2]
    assert timed_out, "no request waited for a connection: the fault did not land"

"""The console in a real browser: Playwright driving Debian's Chromium (never a browser of its
own) against the production shape (the HTTP API, a cpu worker with beat and a gpu worker on
Redis, Postgres, moto's S3) and the real default model. A team lead logs in, submits nothing
through the page, watches a real batch progress to completed, cancels another, retries the
failed lines of the first, downloads its output, and opens every page; each screenshot is
checked not to be blank. Another project's key sees nothing of it.

Screenshots go to a temporary folder, or to ``$NIGHTSHIFT_CONSOLE_SCREENSHOTS`` when set (the
README's pictures: ``NIGHTSHIFT_CONSOLE_SCREENSHOTS=docs/console python -m pytest
tests/service/test_console_browser.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest

from nightshift.jobs.costs.formatting import money

from .api_fixtures import (Service, free_port, make_key, new_bucket, openai_client, s3_env,  # noqa: F401
                           service_env)
from .celery_procs import redis_db_url

REDIS_DB = 14     # apart from the other service tests' Redis databases
SYSTEM = "You are a terse assistant. Answer in one short sentence."


def chromium_path() -> str:
    """Debian's chromium (scripts/setup.sh installs it); Playwright's own browser download is
    never used (it cannot be fetched here, and the system's is the one to test)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise RuntimeError("no chromium on PATH: run scripts/setup.sh (apt-get install chromium)")
    return found


def chat_lines(tag: str, n: int, max_tokens: int, *, ignore_eos: bool = False, too_long: bool = False) -> bytes:
    lines = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos,
                       "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Name a colour, number {i}."}]}}
             for i in range(n)]
    if too_long:   # refused by the model (prompt + max_tokens over the context): an error line to retry
        lines.append({"custom_id": f"{tag}-too-long", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "default", "max_tokens": 10_000_000,
                               "messages": [{"role": "user", "content": "hi"}]}})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture(scope="module")
def pipeline(pg_url, s3_server, tmp_path_factory):
    """The production shape with one metrics directory for every process (the health page's
    throughput comes from /metrics' counters); yields (service, root URL, bootstrap key)."""
    import redis

    home = tmp_path_factory.mktemp("console-browser")
    broker = redis_db_url(REDIS_DB)
    redis.Redis.from_url(broker).flushdb()
    key = "ns-console-" + uuid.uuid4().hex
    env = service_env(home, database_url=pg_url, broker_url=broker, bootstrap_key=key,
                      bootstrap_project=f"nightly-{uuid.uuid4().hex[:6]}", reconcile_interval_seconds=2,
                      console_poll_seconds=1, **s3_env(s3_server, new_bucket(s3_server)))
    env["PROMETHEUS_MULTIPROC_DIR"] = str(home / "metrics")
    (home / "metrics").mkdir()
    service = Service(env, home)
    try:
        base_url = service.start_api(free_port())
        service.db_url = pg_url
        service.start_worker("cpu,upkeep", beat=True)
        service.start_worker("gpu")
        yield service, base_url.removesuffix("/v1"), key
    finally:
        service.stop()
        redis.Redis.from_url(broker).flushdb()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: the tests run as root in CI, where Chromium's sandbox refuses to start
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    folder = Path(os.environ.get("NIGHTSHIFT_CONSOLE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def screenshot(page, folder: Path, name: str) -> Path:  # noqa: ANN001
    """A full-page PNG, checked to show something: many colours and a real range of brightness."""
    from PIL import Image

    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        low, high = rgb.convert("L").getextrema()
        colours = rgb.getcolors(maxcolors=1 << 20)
    assert high - low > 100, f"{path} is blank (brightness {low}..{high})"
    assert colours is None or len(colours) > 50, f"{path} is nearly blank ({len(colours)} colours)"
    return path


def log_in(browser, root: str, key: str):  # noqa: ANN001, ANN201
    context = browser.new_context(base_url=root, viewport={"width": 1360, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())        # the actions' "are you sure?"
    page.goto("/console/login")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{root}/console")
    return context, page


def wait_for(predicate, timeout: float, what: str, log=lambda: "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout}s\n{log()}"
        time.sleep(0.2)


def create_batch(client, name: str, data: bytes) -> str:  # noqa: ANN001
    file = client.files.create(file=(name, data), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


@pytest.mark.slow
def test_a_team_lead_watches_cancels_retries_downloads_and_sees_every_page(pipeline, browser, shots):
    service, root, key = pipeline
    client = openai_client(f"{root}/v1", key, timeout=60)
    client.post("/schedules", cast_to=object, body={
        "name": "nightly-summaries", "cron": "0 2 * * *", "timezone": "Europe/Berlin",
        "endpoint": "/v1/chat/completions", "model": "default",
        "source": {"type": "prefix", "prefix": "docs/"},
        "prompt_template": {"messages": [{"role": "user", "content": "Summarize:\n{{ document }}"}], "max_tokens": 64}})
    context, page = log_in(browser, root, key)
    loads = []
    page.on("load", lambda _: loads.append(page.url))
    stored = page.evaluate("document.cookie + JSON.stringify(localStorage) + JSON.stringify(sessionStorage)")
    assert key not in stored and all(key not in c["value"] for c in context.cookies())   # HttpOnly: none seen

    watched = create_batch(client, "watched.jsonl", chat_lines("watched", 5, 16, too_long=True))
    longer = create_batch(client, "longer.jsonl", chat_lines("longer", 8, 1024, ignore_eos=True))   # still running when cancelled

    # the list, open while the engine loads and runs: rows change through the poll, no reload
    page.goto("/console")
    row = page.locator(f"tr[data-batch='{watched}']")
    assert row.get_attribute("data-terminal") == "false"
    first_loads = len(loads)
    seen = set()

    def watched_done() -> bool:
        seen.add(row.locator("[data-field=status]").inner_text())
        return row.get_attribute("data-terminal") == "true"

    wait_for(watched_done, 240, "the watched batch completed on the list page", lambda: service.log("worker-gpu"))
    assert len(loads) == first_loads, "the list reloaded instead of updating in place"
    assert row.locator("[data-field=status]").inner_text() == "completed"
    assert seen & {"validating", "in progress", "finalizing"}, seen
    assert float(row.locator("progress").get_attribute("value")) == 1.0
    assert row.locator("[data-field='text.requests']").inner_text() == "6 / 6"
    report = client.get(f"/batches/{watched}/cost", cast_to=object)
    assert row.locator("[data-field='text.cost']").inner_text() == money(report["cost"]["usd"])
    screenshot(page, shots, "batches")

    # cancel the long batch from its page; the page follows it to cancelled
    page.goto(f"/console/batches/{longer}")
    assert page.locator("button", has_text="Cancel batch").count() == 1
    page.click("button:has-text('Cancel batch')")
    page.wait_for_url(f"{root}/console/batches/{longer}")
    wait_for(lambda: page.locator("h1 [data-field=status]").inner_text() == "cancelled", 60,
             "the cancelled batch's page showed cancelled", lambda: service.log("worker-cpu"))
    assert client.batches.retrieve(longer).status == "cancelled"
    assert page.locator("button", has_text="Retry failed lines").count() == 1      # its never-run lines

    # the watched batch's page: figures, chart, downloads, first errors; retry its failed line
    page.goto(f"/console/batches/{watched}")
    assert page.locator("h1 [data-field=status]").inner_text() == "completed"
    assert page.locator("[data-field='text.completed']").inner_text() == "5"
    assert page.locator("[data-field='text.failed']").inner_text() == "1"
    assert page.locator(".chart svg rect").count() > 0
    assert "watched-too-long" in page.locator("table.error-lines").inner_text()
    assert page.locator("[data-testid=cached-share]").inner_text().endswith("%")
    with page.expect_download() as download:
        page.click("ul.files li:has-text('Output') a")
    output = Path(download.value.path()).read_text().splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == [f"watched-{i}" for i in range(5)]
    screenshot(page, shots, "batch")
    page.click("button:has-text('Retry failed lines')")
    page.wait_for_url(lambda url: "/console/batches/batch_" in url and watched not in url)
    retry_id = page.url.rsplit("/", 1)[1]
    assert page.locator(f".meta a[href='/console/batches/{watched}']").count() == 1       # "retry of"
    wait_for(lambda: page.locator("h1 [data-field=status]").inner_text() in ("completed", "failed"), 120,
             "the retry batch ended", lambda: service.log("worker-gpu"))
    retried = client.batches.retrieve(retry_id)
    assert retried.metadata["retry_of"] == watched and retried.request_counts.total == 1
    assert client.batches.retrieve(watched).metadata["retried_by"] == retry_id

    for name, path, heading in (("schedules", "/console/schedules", "nightly-summaries"),
                                ("costs", "/console/costs", "Our cost")):
        page.goto(path)
        assert heading in page.locator("main").inner_text()
        screenshot(page, shots, name)
    page.goto("/console/health")
    # the rate needs a second reading of the counters: the page's own poll brings it (every 5 s)
    wait_for(lambda: page.locator("[data-field='throughput.completion']").inner_text().endswith("/s"), 20,
             "the health page's poll showed a throughput")
    screenshot(page, shots, "health")
    workers = page.locator("table tr.alive")
    assert workers.count() >= 1 and "ready" in workers.first.inner_text()
    totals = page.locator("[data-field='throughput.totals']").inner_text()
    assert not totals.startswith("0 output tokens"), totals      # the engine's counters reach /metrics

    page.click("button:has-text('Log out')")
    page.wait_for_url(f"{root}/console/login")
    screenshot(page, shots, "login")
    page.goto("/console")
    assert page.url == f"{root}/console/login"
    context.close()


@pytest.mark.slow
def test_another_projects_key_sees_nothing_of_it(pipeline, browser):
    service, root, key = pipeline
    owner = openai_client(f"{root}/v1", key, timeout=60)
    batch_id = create_batch(owner, "private.jsonl", chat_lines("private", 1, 4))
    input_file = owner.batches.retrieve(batch_id).input_file_id
    owner.batches.cancel(batch_id)
    stranger_key = make_key(service.db_url, f"stranger-{uuid.uuid4().hex[:6]}")
    context, page = log_in(browser, root, stranger_key)
    assert "No batches" in page.locator("main").inner_text() and batch_id not in page.content()
    answer = page.goto(f"/console/batches/{batch_id}")
    assert answer.status == 404 and f"No batch found with id '{batch_id}'" in page.locator("main").inner_text()
    assert page.goto(f"/console/files/{input_file}/content").status == 404
    poll = context.request.get(f"/console/api/progress?ids={batch_id}")
    assert poll.status == 404
    page.goto("/console/schedules")
    assert "No schedules" in page.locator("main").inner_text()
    page.goto("/console/costs")
    assert page.locator("[data-testid=total-cost]").inner_text() == "$0.000000"
    assert httpx.get(f"{root}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {stranger_key}"}
                     ).status_code == 404                       # as the API answers
    context.close()

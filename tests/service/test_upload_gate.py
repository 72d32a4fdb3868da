"""The API process's guards for bursts: uploads are taken a few at a time (the rest wait
unread, polls pass), and what start-up built is frozen out of the garbage collector's walks."""
from __future__ import annotations

import asyncio
import gc

from nightshift.api.app import UploadGate, create_app


def _scope(method: str, path: str, length: int = 10) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": [(b"content-length", str(length).encode())]}


def test_uploads_run_a_few_at_a_time_while_other_requests_pass(settings_env):
    settings_env(api_concurrent_uploads=2)
    inside, most = 0, 0
    release = asyncio.Event()

    async def app(scope, receive, send):  # noqa: ANN001
        nonlocal inside, most
        if scope["method"] == "GET":
            return
        inside += 1
        most = max(most, inside)
        await release.wait()
        inside -= 1

    async def main() -> None:
        gate = UploadGate(app)
        uploads = [asyncio.create_task(gate(_scope("POST", "/v1/files"), None, None)) for _ in range(6)]
        await asyncio.sleep(0.05)
        assert inside == 2                                     # two parse; four wait, unread
        await asyncio.wait_for(gate(_scope("GET", "/v1/batches/b"), None, None), 1)   # a poll is not held
        release.set()
        await asyncio.wait_for(asyncio.gather(*uploads), 5)

    asyncio.run(main())
    assert most == 2 and inside == 0


def test_an_oversized_upload_is_refused_without_taking_a_slot(settings_env):
    settings = settings_env(api_concurrent_uploads=1, max_file_bytes=1000)
    sent: list[dict] = []

    async def app(scope, receive, send):  # noqa: ANN001
        raise AssertionError("an oversized upload reached the app")

    async def send(message):  # noqa: ANN001
        sent.append(message)

    asyncio.run(UploadGate(app)(_scope("POST", "/v1/files", settings.max_file_bytes + 2 * 1024 * 1024), None, send))
    assert sent[0]["status"] == 400 and b"file_too_large" in sent[1]["body"]


def test_start_up_objects_are_frozen_out_of_collections(settings_env):
    from fastapi.testclient import TestClient

    settings_env()
    gc.unfreeze()
    try:
        with TestClient(create_app()) as client:
            assert client.get("/health").status_code == 200
            assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()


def test_one_gate_serves_a_new_event_loop(settings_env):
    """(An app served again, as tests do, runs in a fresh event loop: the slots follow it.)"""
    settings_env(api_concurrent_uploads=1)

    async def app(scope, receive, send):  # noqa: ANN001
        await asyncio.sleep(0.01)

    gate = UploadGate(app)
    for _ in range(2):
        async def burst() -> None:
            await asyncio.wait_for(asyncio.gather(*(gate(_scope("POST", "/v1/files"), None, None) for _ in range(3))), 5)
        asyncio.run(burst())

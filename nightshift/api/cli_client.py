"""A small HTTP client for the CLI (httpx; the openai package is not needed at run time)."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx

TERMINAL = ("completed", "failed", "expired", "cancelled")
KEY_FILE_NAME = "api_key"   # written by `nightshift serve` under NIGHTSHIFT_HOME when no key is configured


class CLIError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"nightshift: {message}")


def resolve_base_url(explicit: Optional[str] = None) -> str:
    if explicit:
        return explicit.rstrip("/")
    if os.environ.get("NIGHTSHIFT_BASE_URL"):
        return os.environ["NIGHTSHIFT_BASE_URL"].rstrip("/")
    return f"http://127.0.0.1:{os.environ.get('NIGHTSHIFT_PORT', '8000')}/v1"


def local_key_file() -> Path:
    from nightshift.settings import get_settings

    return get_settings().home / KEY_FILE_NAME


def resolve_api_key(explicit: Optional[str] = None) -> str:
    for key in (explicit, os.environ.get("NIGHTSHIFT_API_KEY"), os.environ.get("NIGHTSHIFT_BOOTSTRAP_KEY")):
        if key:
            return key
    path = local_key_file()
    if path.is_file():
        return path.read_text().strip()
    raise CLIError("no API key: pass --api-key, set NIGHTSHIFT_API_KEY, or run `nightshift serve` here first")


def first_line_url(path: str) -> str:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return json.loads(raw)["url"]
                except (ValueError, KeyError, TypeError):
                    break
    return "/v1/chat/completions"


CREATE_BODY = re.compile(rb'^\s*\{\s*"requests"\s*:')


def is_message_batch_file(path: str) -> bool:
    """Whether a file holds Anthropic message batch requests: a create body ``{"requests": [...]}``,
    or JSONL lines ``{"custom_id", "params"}`` (an OpenAI batch file's lines have ``url`` instead)."""
    with open(path, "rb") as f:
        head = f.read(64 * 1024)
    if CREATE_BODY.match(head):
        return True
    try:
        first = json.loads(head.lstrip().split(b"\n", 1)[0])
    except ValueError:
        return False
    return isinstance(first, dict) and "params" in first and "url" not in first


def _message_batch_body(path: str) -> Iterator[bytes]:
    """The create body of a requests file, streamed: the file itself when it is one, else its
    lines wrapped in ``{"requests": [...]}``."""
    with open(path, "rb") as f:
        if CREATE_BODY.match(f.read(4096)):
            f.seek(0)
            yield from iter(lambda: f.read(1 << 20), b"")
            return
        f.seek(0)
        yield b'{"requests": ['
        first = True
        for line in f:
            if line.strip():
                yield (b"" if first else b",") + line.strip()
                first = False
        yield b"]}"


class BatchClient:
    def __init__(self, base_url: str, api_key: str, timeout: float = 600.0):
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"},
                                 timeout=timeout)

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise CLIError(f"{response.request.method} {response.request.url.path}: "
                           f"HTTP {response.status_code}: {message}")
        return response

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:  # noqa: ANN003
        try:
            return self._check(self.http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise CLIError(f"cannot reach {self.http.base_url}: {exc}") from None

    def upload(self, path: str) -> dict:
        with open(path, "rb") as f:
            return self._call("POST", "/files", files={"file": (Path(path).name, f, "application/jsonl")},
                              data={"purpose": "batch"}).json()

    def submit(self, path: str, endpoint: Optional[str] = None) -> dict:
        file = self.upload(path)
        return self._call("POST", "/batches", json={"input_file_id": file["id"],
                                                    "endpoint": endpoint or first_line_url(path),
                                                    "completion_window": "24h"}).json()

    def submit_messages(self, path: str) -> dict:
        """A message batch (Anthropic's face) of a file of ``{"custom_id", "params"}`` lines, or of
        a whole create body ``{"requests": [...]}``; the body streams from the file."""
        return self._call("POST", "/messages/batches", content=_message_batch_body(path),
                          headers={"content-type": "application/json"}).json()

    def message_batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/messages/batches/{batch_id}").json()

    def message_batch_results(self, batch_id: str) -> Iterator[bytes]:
        return self._stream(f"/messages/batches/{batch_id}/results")

    def retry(self, batch_id: str, error_codes: Optional[list[str]] = None) -> dict:
        body = {"error_codes": error_codes} if error_codes else {}
        return self._call("POST", f"/batches/{batch_id}/retry", json=body).json()

    def batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/batches/{batch_id}").json()

    def file_content(self, file_id: str) -> Iterator[bytes]:
        return self._stream(f"/files/{file_id}/content")

    def _stream(self, path: str) -> Iterator[bytes]:
        """A GET's body as it arrives."""
        try:
            with self.http.stream("GET", path) as response:
                self._check(response)
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise CLIError(f"cannot reach {self.http.base_url}: {exc}") from None

    def wait(self, batch_id: str, show_progress: bool = True, poll_seconds: float = 0.5) -> dict:
        """Poll until the batch is terminal, drawing request progress on stderr."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[extra]}"))
        with Progress(*columns, console=Console(file=sys.stderr), disable=not show_progress) as bar:
            task = bar.add_task(batch_id, total=None, extra="")
            while True:
                batch = self.batch(batch_id)
                counts = batch["request_counts"]
                done = counts["completed"] + counts["failed"]
                eta = (batch.get("progress") or {}).get("eta_seconds")
                extra = f"{batch['status']}" + (f", eta {eta:.0f}s" if eta else "")
                bar.update(task, total=counts["total"] or None, completed=done, extra=extra)
                if batch["status"] in TERMINAL:
                    return batch
                time.sleep(poll_seconds)

"""The embedded broker's message files: whole or not there at all, and a corrupt file left by
an older writer is skipped instead of stopping the consumer."""
from __future__ import annotations

import multiprocessing
import os
import uuid

from kombu import Connection

from nightshift.workers.filesystem_broker import TMP_PREFIX


def _queue_name() -> str:
    # kombu keeps exchange bindings in class-level state shared by every connection of the
    # process (other tests' Celery apps included): each test uses a queue of its own.
    return f"q{uuid.uuid4().hex[:12]}"


def _connection(folder):  # noqa: ANN001, ANN202
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder), "store_processed": False,
               "control_folder": str(folder / "control"), "polling_interval": 0.01}
    (folder / "control").mkdir(exist_ok=True)
    return Connection("filesystem://", transport="nightshift.workers.filesystem_broker:Transport",
                      transport_options=options)


def _publish(folder, sent: int, name: str) -> None:  # noqa: ANN001
    with _connection(folder) as conn:
        queue = conn.SimpleQueue(name)
        for i in range(sent):
            queue.put({"n": i, "pad": "x" * 2_000_000})   # big: a slow write, a wide window


def test_messages_appear_whole_while_a_consumer_polls(tmp_path):
    """A consumer draining the folder while another process publishes never reads a partial file."""
    sent, name = 40, _queue_name()
    publisher = multiprocessing.get_context("fork").Process(target=_publish, args=(tmp_path, sent, name))
    received = []
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue(name)
        publisher.start()
        while len(received) < sent:
            try:
                message = queue.get(timeout=10)
            except queue.Empty:
                break
            received.append(message.payload["n"])
            message.ack()
        publisher.join()
    assert sorted(received) == list(range(sent))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(TMP_PREFIX)]


def test_an_empty_message_file_is_skipped_not_fatal(tmp_path):
    name = _queue_name()
    (tmp_path / f"0000000000001_dead.{name}.msg").write_bytes(b"")     # a writer killed mid-write (old kombu)
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue(name)
        queue.put({"n": 1})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 1}
        message.ack()


def test_the_app_makes_its_folders_when_it_first_publishes_not_on_import(tmp_path):
    import subprocess
    import sys

    from nightshift.workers.procs import service_env

    home = tmp_path / "home"
    env = service_env(home=home)
    imported = subprocess.run([sys.executable, "-c", "import nightshift.workers.tasks, nightshift.workers.schedule_tasks"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert not home.exists()
    published = subprocess.run([sys.executable, "-c", "from nightshift.workers.dispatch import enqueue_ingest; "
                                "enqueue_ingest('batch_x')"], env=env, capture_output=True, text=True, timeout=120)
    assert published.returncode == 0, published.stderr
    assert [p.name for p in (home / "broker" / "queue").iterdir()][0].endswith(".cpu.msg")

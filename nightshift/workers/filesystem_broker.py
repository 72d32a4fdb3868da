"""The embedded broker: kombu's ``filesystem://`` transport with atomic message files.

kombu writes a message by opening its final file name and then writing into it. A consumer
that lists the folder in between moves away an empty file, fails to parse it and stops with
"Unrecoverable error: JSONDecodeError"; a writer killed in between leaves the empty file
behind, and the worker dies on it at every start. Here a message is written under a
temporary name (one the consumers skip) and renamed into place, so a consumer only ever sees
whole messages; a file that still cannot be parsed is dropped with a warning instead of
stopping the worker (messages are wake-ups: the reconciler repairs a lost one from the
database). The folders are made when a channel opens, i.e. when a worker starts consuming or
a producer first publishes, never when the Celery app is imported.
"""
from __future__ import annotations

import logging
import os
import uuid
from json import JSONDecodeError
from pathlib import Path

from kombu.transport import filesystem
from kombu.utils.json import dumps
from kombu.utils.encoding import str_to_bytes
from kombu.transport.virtual.base import Empty

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"          # "partition('.')" of this name never matches "<queue>.msg"


class Channel(filesystem.Channel):
    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        for folder in (self.data_folder_in, self.data_folder_out, self.processed_folder, self.control_folder):
            Path(folder).mkdir(parents=True, exist_ok=True)

    def _put(self, queue, payload, **kwargs):  # noqa: ANN001, ANN003, ANN202
        name = "{}_{}.{}.msg".format(int(round(filesystem.monotonic() * 1000)), uuid.uuid4(), queue)
        tmp = os.path.join(self.data_folder_out, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(tmp, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {name!r} to directory") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _get(self, queue):  # noqa: ANN001, ANN202
        while True:
            try:
                return super()._get(queue)
            except (JSONDecodeError, UnicodeDecodeError) as exc:
                log.warning("dropped an unreadable message file of queue %s (%s); the reconciler "
                            "re-sends lost work", queue, exc)
            except Empty:
                raise


class Transport(filesystem.Transport):
    Channel = Channel

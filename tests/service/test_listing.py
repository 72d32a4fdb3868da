"""Cursor pages of files and batches on both databases, including rows created in the same
instant (the cursor is (created_at, id), so ties neither repeat nor vanish between pages)."""
from __future__ import annotations

import io

import pytest

from nightshift.jobs.batches import service as batch_service
from nightshift.jobs.batches.models import Batch
from nightshift.jobs.errors import NotFound
from nightshift.jobs.files import service as files
from nightshift.jobs.files.models import File
from nightshift.jobs.files.uploads import create_file
from nightshift.settings import Settings
from nightshift.storage.db import session_scope
from nightshift.storage.localdir import LocalDirStore

from .factories import make_project

SAME_INSTANT = 1_790_000_000.0


def _pages(fetch, limit: int) -> list[list[str]]:  # noqa: ANN001
    pages, after = [], None
    while True:
        rows, has_more = fetch(after, limit)
        pages.append([r.id for r in rows])
        if not has_more:
            return pages
        after = rows[-1].id


def test_batches_page_newest_first_through_ties(any_db):
    project = make_project(any_db)
    with session_scope(any_db) as s:
        fid = File(id="file-x", project_id=project, filename="x.jsonl", purpose="batch", object_key="k")
        s.add(fid)
        s.flush()
        times = [SAME_INSTANT] * 4 + [SAME_INSTANT + 1] * 3
        for i, t in enumerate(times):
            s.add(Batch(id=f"batch_{i:02d}", project_id=project, input_file_id="file-x", endpoint="/v1/completions",
                        status="validating", created_at=t))

    def fetch(after, limit):  # noqa: ANN001, ANN202
        with session_scope(any_db) as s:
            return batch_service.list_batches(s, project, after=after, limit=limit)

    pages = _pages(fetch, 3)
    flat = [i for page in pages for i in page]
    assert flat == ["batch_06", "batch_05", "batch_04", "batch_03", "batch_02", "batch_01", "batch_00"]
    assert [len(p) for p in pages] == [3, 3, 1]
    other = make_project(any_db)
    with session_scope(any_db) as s, pytest.raises(NotFound):
        batch_service.list_batches(s, other, after="batch_03")


def test_files_page_both_orders_and_hide_deleted(any_db, tmp_path):
    project = make_project(any_db)
    store = LocalDirStore(tmp_path / "objects")
    settings = Settings(home=tmp_path)
    ids = []
    with session_scope(any_db) as s:
        for i in range(5):
            row = create_file(s, store, settings, project_id=project, filename=f"f{i}.jsonl", purpose="batch",
                                    source=io.BytesIO(b'{"a": 1}\n{"b": 2}'))
            assert (row.bytes, row.line_count) == (17, 2)
            row.created_at = SAME_INSTANT   # all in one instant: only the id orders them
            ids.append(row.id)
    with session_scope(any_db) as s:
        files.delete_file(s, project, ids[2])

    def fetch(order):  # noqa: ANN001, ANN202
        def page(after, limit):  # noqa: ANN001, ANN202
            with session_scope(any_db) as s:
                return files.list_files(s, project, after=after, limit=limit, order=order)
        return page

    live = sorted(i for i in ids if i != ids[2])
    assert [i for p in _pages(fetch("asc"), 2) for i in p] == live
    assert [i for p in _pages(fetch("desc"), 2) for i in p] == live[::-1]

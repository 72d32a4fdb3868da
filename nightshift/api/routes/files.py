"""/v1/files: upload, list, retrieve, delete, content."""
from __future__ import annotations

from typing import Literal, Optional
from urllib.parse import quote

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from nightshift.api.deps import CallerDep, ProjectCaller, SettingsDep, StoreDep
from nightshift.api.errors import APIError
from nightshift.api.schemas.common import ListPage
from nightshift.api.schemas.files import FileDeleted, FileObject
from nightshift.jobs.files import service as file_service
from nightshift.jobs.files import uploads
from nightshift.jobs.files.models import File
from nightshift.storage.objectstore import ObjectStore

router = APIRouter(prefix="/v1/files", tags=["files"])


def file_object(row: File) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at), filename=row.filename,
                      purpose=row.purpose, status=row.status,
                      expires_at=int(row.expires_at) if row.expires_at is not None else None,
                      status_details=row.status_details)


@router.post("", response_model=FileObject)
async def upload_file(caller: CallerDep, store: StoreDep, settings: SettingsDep,
                      file: UploadFile, purpose: str = Form(...),
                      expires_after_anchor: Optional[str] = Form(None, alias="expires_after[anchor]"),
                      expires_after_seconds: Optional[int] = Form(None, alias="expires_after[seconds]")) -> FileObject:
    if expires_after_seconds is not None:
        if expires_after_anchor != "created_at":
            raise APIError(400, "expires_after[anchor] must be 'created_at'.", param="expires_after.anchor",
                           code="invalid_value")
        if not 3600 <= expires_after_seconds <= 2_592_000:
            raise APIError(400, "expires_after[seconds] must be between 3600 and 2592000.",
                           param="expires_after.seconds", code="invalid_value")
    project_id = await caller.read(lambda _, project: project)   # a bad key is refused before the upload
    # The upload streams into the object store with no database connection held.
    upload = await run_in_threadpool(uploads.store_upload, store, settings,
                                     filename=file.filename or "upload.jsonl", purpose=purpose, source=file.file)
    try:
        row = await caller.database.run(lambda session: uploads.record_file(session, project_id, upload,
                                                                            expires_after_seconds))
    except BaseException:
        await run_in_threadpool(store.delete, upload.object_key)
        raise
    return file_object(row)


@router.get("", response_model=ListPage[FileObject])
async def list_files(caller: CallerDep, after: Optional[str] = None,
                     limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = "desc",
                     purpose: Optional[str] = None) -> ListPage[FileObject]:
    def page(session: Session, project_id: str) -> ListPage[FileObject]:
        rows, has_more = file_service.list_files(session, project_id, after=after, limit=limit, order=order,
                                                 purpose=purpose)
        return ListPage[FileObject].of([file_object(r) for r in rows], has_more)

    return await caller.read(page)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: str, caller: CallerDep) -> FileObject:
    return await caller.read(lambda session, project_id: file_object(file_service.get_file(session, project_id,
                                                                                            file_id)))


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, caller: CallerDep, store: StoreDep) -> FileDeleted:
    row = await caller.run(lambda session, project_id: file_service.delete_file(session, project_id, file_id))
    await run_in_threadpool(file_service.delete_content, store, row)   # after the commit
    return FileDeleted(id=row.id, deleted=True)


@router.get("/{file_id}/content")
async def file_content(file_id: str, caller: CallerDep, store: StoreDep) -> StreamingResponse:
    return await file_download(caller, store, file_id)


async def file_download(caller: ProjectCaller, store: ObjectStore, file_id: str) -> StreamingResponse:
    """The file's content as an attachment (the API's and the console's download)."""
    # The row is read and the session closed before the first byte: a slow reader holds no connection.
    row = await caller.read(lambda session, project_id: file_service.get_file(session, project_id, file_id))
    chunks = await run_in_threadpool(file_service.file_content, store, row)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-disposition": content_disposition(row.filename)})


def content_disposition(filename: str) -> str:
    """RFC 6266: an ASCII fallback name plus the exact name as ``filename*=UTF-8''...`` (HTTP
    headers are Latin-1, so a name such as 日本語.jsonl cannot go in the plain parameter)."""
    fallback = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"

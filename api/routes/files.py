"""/v1/files: upload, list, retrieve, delete, content."""
from __future__ import annotations

from typing import Literal, Optional

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from api.deps import ProjectDep, SessionDep, SettingsDep, StoreDep
from api.errors import APIError
from api.schemas.common import ListPage
from api.schemas.files import FileDeleted, FileObject
from jobs import files as file_service
from jobs.models import File

router = APIRouter(prefix="/v1/files", tags=["files"])


def file_object(row: File) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=int(row.created_at), filename=row.filename,
                      purpose=row.purpose, status=row.status,
                      expires_at=int(row.expires_at) if row.expires_at is not None else None,
                      status_details=row.status_details)


@router.post("", response_model=FileObject)
def upload_file(project_id: ProjectDep, session: SessionDep, store: StoreDep, settings: SettingsDep,
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
    row = file_service.create_file(session, store, settings, project_id=project_id,
                                   filename=file.filename or "upload.jsonl", purpose=purpose, source=file.file,
                                   expires_after_seconds=expires_after_seconds)
    session.commit()
    return file_object(row)


@router.get("", response_model=ListPage[FileObject])
def list_files(project_id: ProjectDep, session: SessionDep, after: Optional[str] = None,
               limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = "desc",
               purpose: Optional[str] = None) -> ListPage[FileObject]:
    rows, has_more = file_service.list_files(session, project_id, after=after, limit=limit, order=order,
                                             purpose=purpose)
    return ListPage[FileObject].of([file_object(r) for r in rows], has_more)


@router.get("/{file_id}", response_model=FileObject)
def retrieve_file(file_id: str, project_id: ProjectDep, session: SessionDep) -> FileObject:
    return file_object(file_service.get_file(session, project_id, file_id))


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, project_id: ProjectDep, session: SessionDep, store: StoreDep) -> FileDeleted:
    row = file_service.delete_file(session, project_id, file_id)
    session.commit()
    file_service.delete_content(store, row)
    return FileDeleted(id=row.id, deleted=True)


@router.get("/{file_id}/content")
def file_content(file_id: str, project_id: ProjectDep, session: SessionDep, store: StoreDep) -> StreamingResponse:
    row = file_service.get_file(session, project_id, file_id)
    chunks = file_service.file_content(store, row)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-disposition": f'attachment; filename="{row.filename}"'})

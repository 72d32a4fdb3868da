"""Schemas of /v1/schedules."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field


class PrefixSource(BaseModel):
    """Objects under an object-store prefix: each one a document ("documents", rendered with
    prompt_template), or JSONL objects whose lines are complete requests ("jsonl")."""

    type: Literal["prefix"]
    prefix: str
    format: Literal["documents", "jsonl"] = "documents"


class FileSource(BaseModel):
    """A stored batch input file (JSONL); each line is one document, keyed by custom_id."""

    type: Literal["file"]
    file_id: str


Source = Union[PrefixSource, FileSource]


class ScheduleCreate(BaseModel):
    name: str
    cron: str = Field(description="5-field cron expression, e.g. '0 2 * * *'")
    timezone: str = "UTC"
    endpoint: str
    model: str = "default"
    source: Source = Field(discriminator="type")
    prompt_template: Optional[dict[str, Any]] = Field(
        None, description="request body; strings may use {{ document }} and {{ key }}")
    index_prefix: Optional[str] = None
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = None


class ScheduleUpdate(BaseModel):
    name: Optional[str] = None
    cron: Optional[str] = None
    timezone: Optional[str] = None
    endpoint: Optional[str] = None
    model: Optional[str] = None
    source: Optional[Source] = Field(None, discriminator="type")
    prompt_template: Optional[dict[str, Any]] = None
    index_prefix: Optional[str] = None
    completion_window: Optional[str] = None
    metadata: Optional[dict[str, str]] = None


class ScheduleObject(BaseModel):
    id: str
    object: Literal["schedule"] = "schedule"
    name: str
    cron: str
    timezone: str
    status: Literal["active", "paused"]
    endpoint: str
    model: str
    source: dict[str, Any]
    prompt_template: Optional[dict[str, Any]] = None
    index_prefix: Optional[str] = None
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    next_run_at: Optional[int] = None
    created_at: int
    updated_at: int


class ScheduleRunObject(BaseModel):
    id: str
    object: Literal["schedule.run"] = "schedule.run"
    schedule_id: str
    due_at: int
    fired_at: int
    status: Literal["pending", "submitted", "succeeded", "failed", "skipped"]
    batch_id: Optional[str] = None
    input_file_id: Optional[str] = None
    documents_total: int = 0
    documents_selected: int = 0
    documents_indexed: int = 0
    documents_failed: int = 0
    documents_removed: int = 0
    error: Optional[str] = None
    finished_at: Optional[int] = None


class ScheduleDeleted(BaseModel):
    id: str
    object: Literal["schedule"] = "schedule"
    deleted: bool = True

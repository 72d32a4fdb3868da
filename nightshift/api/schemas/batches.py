from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]


class OutputExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class BatchCreate(BaseModel):
    """Body of POST /v1/batches. endpoint and completion_window are checked by the route,
    so that their errors carry OpenAI's exact wording."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[OutputExpiresAfter] = None


class BatchRetry(BaseModel):
    """Body of POST /v1/batches/{batch_id}/retry (optional): which failed lines to run again
    (by error code; all of them when left out) and metadata for the new batch."""

    error_codes: Optional[list[str]] = Field(default=None, min_length=1)
    metadata: Optional[dict[str, str]] = None


class BatchErrorItem(BaseModel):
    code: Optional[str] = None
    message: Optional[str] = None
    param: Optional[str] = None
    line: Optional[int] = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class BatchProgress(BaseModel):
    """Nightshift extension; the openai client keeps unknown fields (``batch.progress``)."""

    requests_done: int
    tokens_done: int           # prompt + output tokens of finished requests
    tokens_planned: int        # prompt + max_tokens of every request (an upper bound)
    cached_tokens: int         # prompt tokens served from the engine's prefix cache
    fraction: float            # requests_done / total
    eta_seconds: Optional[float] = None
    # why shards wait, when they wait on a model no worker could load ("no worker could load
    # model X: <cause>"); they end as model_unavailable error lines if it does not load in time
    notice: Optional[str] = None


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: Optional[str] = None
    errors: Optional[BatchErrors] = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    created_at: int
    in_progress_at: Optional[int] = None
    expires_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: Optional[dict[str, str]] = None
    progress: Optional[BatchProgress] = None

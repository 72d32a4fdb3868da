"""A batch as OpenAI's batch object (plus our ``progress``): the one rendering the API answers
with and webhooks deliver."""
from __future__ import annotations

from typing import Any, Optional

from nightshift.jobs.batches.models import Batch
from nightshift.jobs.batches.progress import BatchProgress

_TIMES = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


def _seconds(value: Optional[float]) -> Optional[int]:
    return int(value) if value is not None else None


def batch_document(batch: Batch, progress: BatchProgress) -> dict[str, Any]:
    return {"id": batch.id, "object": "batch", "endpoint": batch.endpoint, "model": batch.model,
            "errors": batch.errors, "input_file_id": batch.input_file_id,
            "completion_window": batch.completion_window, "status": batch.status,
            "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": int(batch.created_at), **{name: _seconds(getattr(batch, name)) for name in _TIMES},
            "request_counts": progress.request_counts(), "usage": progress.usage(), "metadata": batch.metadata_,
            "progress": progress.progress()}

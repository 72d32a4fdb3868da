"""What the console shows of a batch, built from the same batch document the API answers with
(jobs/batches/documents.py): pure functions, shared by the pages (first render) and the live
poll (every few seconds), so both show the same figures in the same words."""
from __future__ import annotations

from typing import Any, Optional

from nightshift.api.console.rendering import duration
from nightshift.jobs.batches.documents import batch_document
from nightshift.jobs.batches.lifecycle import CANCELLABLE
from nightshift.jobs.batches.models import Batch, BatchStatus
from nightshift.jobs.batches.progress import BatchProgress
from nightshift.jobs.costs.formatting import money, number

STATE_TIMES = (("created", "created_at"), ("in progress", "in_progress_at"), ("finalizing", "finalizing_at"),
               ("cancelling", "cancelling_at"), ("completed", "completed_at"), ("failed", "failed_at"),
               ("expired", "expired_at"), ("cancelled", "cancelled_at"))


def live_view(batch: Batch, progress: BatchProgress, cost_usd: float) -> dict[str, Any]:
    """The figures a page keeps fresh: status, counts, tokens, ETA and cost so far, raw and as text."""
    p = progress.progress()
    terminal = batch.status in BatchStatus.TERMINAL
    if terminal:
        eta = "done"
    elif p["notice"]:
        eta = "waiting"
    elif p["eta_seconds"] is not None:
        eta = duration(p["eta_seconds"])
    else:
        eta = "estimating" if batch.status == BatchStatus.IN_PROGRESS else "-"
    return {"id": batch.id, "status": batch.status, "terminal": terminal,
            "total": progress.total, "completed": progress.completed, "failed": progress.failed,
            "requests_done": p["requests_done"], "fraction": p["fraction"],
            "tokens_done": p["tokens_done"], "input_tokens": progress.input_tokens,
            "cached_tokens": progress.cached_tokens, "output_tokens": progress.output_tokens,
            "eta_seconds": p["eta_seconds"], "notice": p["notice"], "cost_usd": cost_usd,
            "text": {"model": batch.model or "-", "requests": f"{number(p['requests_done'])} / {number(progress.total)}",
                     "tokens": number(p["tokens_done"]), "eta": eta, "cost": money(cost_usd),
                     "percent": f"{p['fraction']:.0%}", "completed": number(progress.completed),
                     "failed": number(progress.failed), "input_tokens": number(progress.input_tokens),
                     "cached_tokens": number(progress.cached_tokens),
                     "output_tokens": number(progress.output_tokens),
                     "cached_share": cached_share_text(progress)}}


def cached_share_text(progress: BatchProgress) -> str:
    if not progress.input_tokens:
        return "-"
    return f"{progress.cached_tokens / progress.input_tokens:.1%}"


def batch_row(batch: Batch, progress: BatchProgress, cost_usd: float) -> dict[str, Any]:
    """One row of the batches list: the batch document plus its live figures."""
    return {"doc": batch_document(batch, progress), "live": live_view(batch, progress, cost_usd)}


def state_timeline(batch: Batch) -> list[tuple[str, float]]:
    """The states the batch went through, with when, in order."""
    return sorted(((label, getattr(batch, field)) for label, field in STATE_TIMES
                   if getattr(batch, field) is not None), key=lambda item: item[1])


def can_cancel(batch: Batch) -> bool:
    return batch.status in CANCELLABLE


def can_retry(batch: Batch, progress: BatchProgress) -> bool:
    """An ended batch with failed lines (retry.failed_lines has the final word)."""
    return batch.status in BatchStatus.TERMINAL and progress.failed > 0


def _files(batch: Batch, report: dict) -> list[tuple[str, str]]:
    cost = report.get("files") or {}
    wanted = (("Input", batch.input_file_id), ("Output", batch.output_file_id), ("Errors", batch.error_file_id),
              ("Cost report (JSON)", cost.get("json")), ("Cost per request (CSV)", cost.get("csv")))
    return [(label, file_id) for label, file_id in wanted if file_id]


def download_ids(batch: Batch, report: dict) -> list[str]:
    return [file_id for _, file_id in _files(batch, report)]


def downloads(batch: Batch, report: dict, files: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's files, each with its row (None once deleted) for the download link."""
    return [{"label": label, "id": file_id, "file": files.get(file_id)} for label, file_id in _files(batch, report)]


def link_of(batch: Batch, key: str) -> Optional[str]:
    """A batch id the batch's metadata links to (``retry_of``, ``retried_by``)."""
    value = (batch.metadata_ or {}).get(key)
    return value if isinstance(value, str) and value.startswith("batch_") else None



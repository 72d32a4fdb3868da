"""Progress of batches as the API shows it: request counts, usage, an ETA and, while shards wait
on a model no worker could load, why (model_waits.py), summed over their shard rows in one query."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import bindparam, case, func, select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, BatchStatus, Shard, ShardStatus


@dataclass
class BatchProgress:
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    engine_seconds: float = 0.0
    planned_tokens: int = 0
    eta_seconds: Optional[float] = None
    notice: Optional[str] = None          # why pending shards wait ("no worker could load model X: ...")

    def request_counts(self) -> dict:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}

    def progress(self) -> dict:
        """Our extension field on the batch object."""
        done = self.completed + self.failed
        return {"requests_done": done, "tokens_done": self.input_tokens + self.output_tokens,
                "tokens_planned": self.planned_tokens, "cached_tokens": self.cached_tokens,
                "fraction": (done / self.total) if self.total else 0.0, "eta_seconds": self.eta_seconds,
                "notice": self.notice}


# Every batch poll runs this: built once, as a Core statement (no per-call expression building).
_shards = Shard.__table__
_SUMS = (select(_shards.c.batch_id, func.sum(_shards.c.completed_count), func.sum(_shards.c.failed_count),
                func.sum(_shards.c.prompt_tokens), func.sum(_shards.c.prefix_hit_tokens),
                func.sum(_shards.c.completion_tokens), func.sum(_shards.c.engine_seconds),
                func.max(case((_shards.c.status == ShardStatus.PENDING, _shards.c.load_error))))
         .where(_shards.c.batch_id.in_(bindparam("batch_ids", expanding=True))).group_by(_shards.c.batch_id))


def batch_progress(s: Session, batches: list[Batch], now: Optional[float] = None) -> dict[str, BatchProgress]:
    """request_counts, usage and progress for several batches in one query (sums over shard rows)."""
    now = time.time() if now is None else now
    ids = [b.id for b in batches]
    out = {b.id: BatchProgress(total=b.request_total, planned_tokens=b.planned_prompt_tokens + b.planned_max_tokens)
           for b in batches}
    if not ids:
        return out
    rows = s.execute(_SUMS, {"batch_ids": ids}).all()
    for batch_id, completed, failed, prompt, cached, completion, secs, notice in rows:
        p = out[batch_id]
        p.notice = notice
        p.completed, p.failed = int(completed or 0), int(failed or 0)
        p.input_tokens, p.cached_tokens, p.output_tokens = int(prompt or 0), int(cached or 0), int(completion or 0)
        p.engine_seconds = float(secs or 0.0)
    for b in batches:
        p = out[b.id]
        done = p.completed + p.failed
        if b.status == BatchStatus.IN_PROGRESS and b.in_progress_at and 0 < done < p.total and p.notice is None:
            p.eta_seconds = (now - b.in_progress_at) * (p.total - done) / done
        elif b.status in BatchStatus.TERMINAL:
            p.eta_seconds = 0.0
    return out

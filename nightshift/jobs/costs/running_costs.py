"""What batches have cost so far, for a page that polls it: summed over their shard rows (engine
seconds per device, one grouped query), not over their request rows, so a poll stays cheap for a
batch of any size.

A shard's engine seconds are the exact sum of its answered requests' (written in the same
transaction, leases.write_results); its device is that of its last claim. So the figure equals the
cost report's (summed over request rows) unless a shard was re-run on a device kind with another
price, whose earlier requests are then priced at the last device's price. The cost report of an
ended batch (cost.json) is the exact figure.
"""
from __future__ import annotations

import math
from typing import Sequence

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from nightshift.jobs.batches.models import Batch, Shard
from nightshift.jobs.costs.accounting import prices_from_settings
from nightshift.settings import Settings

_shards = Shard.__table__
_SECONDS_BY_DEVICE = (select(_shards.c.batch_id, _shards.c.device, func.sum(_shards.c.engine_seconds))
                      .where(_shards.c.batch_id.in_(bindparam("batch_ids", expanding=True)))
                      .group_by(_shards.c.batch_id, _shards.c.device))


def costs_so_far(session: Session, batches: Sequence[Batch], settings: Settings) -> dict[str, float]:
    """Dollars of engine time each batch has used so far (0.0 before any ran); devices without a
    configured price count nothing, as in the cost report."""
    out = {b.id: [] for b in batches}
    if not batches:
        return {}
    prices = {b.id: prices_from_settings(settings, b.endpoint) for b in batches}
    for batch_id, device, seconds in session.execute(_SECONDS_BY_DEVICE, {"batch_ids": list(out)}):
        price = prices[batch_id].hourly_price(device)
        if seconds and price is not None:
            out[batch_id].append(float(seconds) * price / 3600.0)
    return {batch_id: math.fsum(parts) for batch_id, parts in out.items()}

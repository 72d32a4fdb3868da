"""Cron due-time arithmetic for schedules (pure; croniter + zoneinfo).

A schedule fires at due times: the instants its cron expression matches on the wall clock
of its timezone (so "0 2 * * *" in Europe/Berlin is 02:00 Berlin time, DST included). All
values in and out are timezone-aware UTC datetimes.

Catch-up rule: when the service was down over several due times, only the latest one that
has passed fires (once); the older missed ones are skipped.

The rows store Unix seconds; ``utc`` and ``next_due_at`` convert at that boundary.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Optional
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from nightshift.jobs.errors import InvalidInput

_EPSILON = timedelta(microseconds=1)


class InvalidScheduleError(InvalidInput):
    """A schedule field that cannot be used; `param` names it (the API answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param, "invalid_value")


def parse_timezone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidScheduleError("timezone", f"unknown timezone {name!r}") from exc


def validate_cron(expression: str, timezone_name: str) -> None:
    """Raise InvalidScheduleError naming the field unless both parse."""
    parse_timezone(timezone_name)
    fields = expression.split()
    if len(fields) != 5 or not croniter.is_valid(expression):
        raise InvalidScheduleError(
            "cron", f"invalid cron expression {expression!r}: expected 5 fields "
                    "'minute hour day-of-month month day-of-week', e.g. '0 2 * * *'")


def _require_aware(value: datetime, name: str) -> None:
    if value.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware")


def next_due_after(expression: str, timezone_name: str, after: datetime) -> datetime:
    """The first due time strictly after `after`."""
    _require_aware(after, "after")
    local = after.astimezone(parse_timezone(timezone_name))
    return croniter(expression, local).get_next(datetime).astimezone(timezone.utc)


def latest_due_at_or_before(expression: str, timezone_name: str, now: datetime) -> datetime:
    """The last due time at or before `now`."""
    _require_aware(now, "now")
    local = (now + _EPSILON).astimezone(parse_timezone(timezone_name))
    return croniter(expression, local).get_prev(datetime).astimezone(timezone.utc)


def due_time_to_fire(expression: str, timezone_name: str, *, fire_after: datetime,
                     now: datetime) -> Optional[datetime]:
    """The due time to fire now, or None: the latest due time in (fire_after, now].

    `fire_after` is the last due time already fired (or the moment the schedule was
    created or resumed). Missed due times in between collapse into this single one.
    """
    _require_aware(fire_after, "fire_after")
    if now <= fire_after:
        return None
    due = latest_due_at_or_before(expression, timezone_name, now)
    return due if due > fire_after else None


def utc(ts: float) -> datetime:
    """Unix seconds as an aware UTC datetime."""
    return datetime.fromtimestamp(ts, timezone.utc)


def next_due_at(expression: str, timezone_name: str, after: float) -> float:
    """``next_due_after`` in Unix seconds."""
    return next_due_after(expression, timezone_name, utc(after)).timestamp()

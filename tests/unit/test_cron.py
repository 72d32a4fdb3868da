"""Due-time rules: timezones, DST, exact boundaries, catch-up once."""
from datetime import datetime, timedelta, timezone

import pytest

from nightshift.jobs.schedules.cron import (InvalidScheduleError, due_time_to_fire, latest_due_at_or_before,
                                            next_due_after, validate_cron)

UTC = timezone.utc


def test_next_due_in_timezone_including_dst_change():
    # 02:00 Berlin = 01:00 UTC in winter, 00:00 UTC in summer (DST starts 2026-03-29)
    assert next_due_after("0 2 * * *", "Europe/Berlin", datetime(2026, 3, 27, 12, tzinfo=UTC)) \
        == datetime(2026, 3, 28, 1, tzinfo=UTC)
    assert next_due_after("0 4 * * *", "Europe/Berlin", datetime(2026, 3, 28, 12, tzinfo=UTC)) \
        == datetime(2026, 3, 29, 2, tzinfo=UTC)
    assert next_due_after("0 2 * * *", "UTC", datetime(2026, 3, 27, 2, tzinfo=UTC)) \
        == datetime(2026, 3, 28, 2, tzinfo=UTC)


def test_due_exactly_at_now_fires_and_only_once():
    due = datetime(2026, 11, 22, 2, tzinfo=UTC)
    assert due_time_to_fire("0 2 * * *", "UTC", fire_after=due - timedelta(days=1), now=due) == due
    assert due_time_to_fire("0 2 * * *", "UTC", fire_after=due, now=due) is None
    assert due_time_to_fire("0 2 * * *", "UTC", fire_after=due,
                            now=due + timedelta(hours=23)) is None
    assert due_time_to_fire("0 2 * * *", "UTC", fire_after=due - timedelta(days=1),
                            now=due - timedelta(microseconds=1)) is None


def test_missed_runs_collapse_into_the_latest():
    fired = datetime(2026, 11, 1, 2, tzinfo=UTC)
    now = datetime(2026, 11, 5, 9, 30, tzinfo=UTC)   # down for 4 nights
    due = due_time_to_fire("0 2 * * *", "UTC", fire_after=fired, now=now)
    assert due == datetime(2026, 11, 5, 2, tzinfo=UTC)
    assert due_time_to_fire("0 2 * * *", "UTC", fire_after=due, now=now) is None


def test_every_five_minutes_boundary():
    now = datetime(2026, 11, 22, 10, 7, 30, tzinfo=UTC)
    assert latest_due_at_or_before("*/5 * * * *", "UTC", now) == datetime(2026, 11, 22, 10, 5, tzinfo=UTC)


@pytest.mark.parametrize("cron,tz,param", [("61 * * * *", "UTC", "cron"), ("* * *", "UTC", "cron"),
                                           ("0 2 * * *", "Mars/Olympus", "timezone")])
def test_invalid_schedule_names_the_field(cron, tz, param):
    with pytest.raises(InvalidScheduleError) as info:
        validate_cron(cron, tz)
    assert info.value.param == param


def test_naive_datetimes_are_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        next_due_after("0 2 * * *", "UTC", datetime(2026, 1, 1))

"""The dead man's switch maths: cadence (twice the longest gap between slots) and the overdue deadline."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from scheduler.timing import Timing, longest_gap, overdue

UTC = timezone.utc
T0 = datetime(2026, 3, 2, 12, 0, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("timing", "expected"),
    [
        (Timing(interval=60), 120),
        (Timing(cron="*/5 * * * *"), 600),
        # Weekdays at 09:00: the longest gap is Friday to Monday, 73 hours over the fall-back weekend.
        (Timing(cron="0 9 * * 1-5", timezone="Europe/Berlin"), 2 * 73 * 3600),
        # On the 31st: months without one make the longest gap Aug 31 -> Oct 31, 61 days.
        (Timing(cron="0 0 31 * *"), 2 * 61 * 86400),
        # Every minute on weekdays: the weekend lies beyond the walked slots; counted from Friday's first slot.
        (Timing(cron="* * * * 1-5"), 2 * 72 * 3600),
        # Every minute but Sundays: Saturday 00:00 to Monday 00:00.
        (Timing(cron="* * * * 1-6"), 2 * 48 * 3600),
        (Timing(run_at=T0), None),
        # Never matches: no gap to measure.
        (Timing(cron="0 0 30 2 *"), None),
    ],
)
def test_cadence__twice_the_longest_gap(timing: Timing, expected: int | None) -> None:
    assert overdue.cadence(timing) == expected


def test_cadence__dst_stretches_the_longest_gap_of_a_daily_cron() -> None:
    # Given a daily job in Berlin: the fall-back day has 25 hours
    cadence = overdue.cadence(Timing(cron="0 12 * * *", timezone="Europe/Berlin"))
    # Then its cadence is twice the longest day, not twice 24 h
    assert cadence == 2 * 25 * 3600


def test_longest_gap__yearly_cron_walks_past_the_span_to_find_two_slots() -> None:
    # Given a leap-day job (every four years)
    gap = longest_gap(Timing(cron="0 0 29 2 *"), since=datetime(2024, 3, 1, tzinfo=UTC))
    # Then the gap is 2028-02-29 to 2032-02-29
    assert gap == datetime(2032, 2, 29, tzinfo=UTC) - datetime(2028, 2, 29, tzinfo=UTC)


def test_deadline__never_succeeded_is_one_window_after_the_first_slot() -> None:
    # Given a schedule every 60 s started at T0 (first slot T0 + 30 s), never succeeded
    deadline = overdue.deadline(Timing(interval=60), window=120, last_success_at=None, since=T0)
    # Then it is overdue 2 intervals after its first slot
    assert deadline == datetime(2026, 3, 2, 12, 1, tzinfo=UTC) + timedelta(seconds=120)


def test_deadline__last_success_later_than_the_first_slot_counts() -> None:
    success = T0 + timedelta(hours=1)
    assert overdue.deadline(Timing(interval=60), window=120, last_success_at=success, since=T0) == success + timedelta(
        seconds=120
    )


def test_deadline__restarted_after_the_last_success_counts_from_the_first_slot_since() -> None:
    # Given a schedule that last succeeded a week before it was resumed at T0
    deadline = overdue.deadline(Timing(interval=60), window=120, last_success_at=T0 - timedelta(days=7), since=T0)
    # Then it gets a full window from its first slot after resuming
    assert deadline == datetime(2026, 3, 2, 12, 1, tzinfo=UTC) + timedelta(seconds=120)


def test_deadline__no_window_is_never_overdue() -> None:
    assert overdue.deadline(Timing(run_at=T0), window=None, last_success_at=None, since=T0) is None

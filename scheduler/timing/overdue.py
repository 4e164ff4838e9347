"""The per-schedule dead man's switch: which schedules have gone too long without a success.

A schedule's window is its ``alert_after`` (seconds) or else its cadence:
twice the longest gap between its consecutive slots (a one-off has none).
It is **overdue** while it is enabled, not paused, and its deadline
(``Schedule.overdue_at``) has passed. The deadline is the window after the
later of its last success and its first slot since it was last started
afresh (created, resumed, enabled again or its timing edited: ``owed_since``),
so a schedule that never succeeded becomes overdue one window after its
first slot, and one resumed after a long pause gets a full window again.

The deadline is stored, not computed at read time, so "which schedules are
overdue" is one range scan of the partial index ``schedule_overdue`` however
many schedules there are. ``scheduler.owners.schedules`` recomputes it
(``deadline``) on an edit of the timing, the state or ``alert_after``, and
every success moves it forward in the same UPDATE that counts the run
(``scheduler.owners.schedules.count_run``). The admin, the ``schedules``
command, ``/metrics`` and ``/healthz/schedules`` all read it through
``Schedule.objects.overdue`` and ``Schedule.is_overdue_at``. What is here
is pure: no database, no models.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from scheduler import timing

#: Cron gaps are measured over the slots after this instant, the same in every process.
_ANCHOR = datetime(2024, 1, 1, tzinfo=timezone.utc)
_TICK = timedelta(microseconds=1)


def cadence(schedule_timing: timing.Timing, *, since: datetime | None = None) -> int | None:
    """Return twice the longest gap between consecutive slots, in whole seconds; None for a one-off.

    A schedule with calendars has gaps where their days fall (a weekend, a
    holiday): they are measured over the year after ``since`` (by default
    the fixed anchor), not cached, as the calendars may change.
    """
    if schedule_timing.run_at is not None:
        return None
    if schedule_timing.days is not None:
        shape = replace(schedule_timing, start_at=None, end_at=None, max_runs=None)
        gap = timing.longest_gap(shape, since=since or _ANCHOR)
        return None if gap is None else math.ceil(2 * gap.total_seconds())
    if schedule_timing.interval is not None:
        return 2 * schedule_timing.interval
    if schedule_timing.cron is None:
        return None
    gap = _cron_gap(
        schedule_timing.cron,
        schedule_timing.timezone,
        schedule_timing.dst_gap,
        schedule_timing.dst_fold,
        schedule_timing.hash_key,
    )
    return None if gap is None else math.ceil(2 * gap.total_seconds())


@functools.lru_cache(maxsize=1024)
def _cron_gap(cron: str, zone: str, dst_gap: str, dst_fold: str, hash_key: str) -> timedelta | None:
    # start_at, end_at and max_runs bound the slots, not the spacing between them.
    shape = timing.Timing(cron=cron, timezone=zone, dst_gap=dst_gap, dst_fold=dst_fold, hash_key=hash_key)
    return timing.longest_gap(shape, since=_ANCHOR)


def deadline(
    schedule_timing: timing.Timing, *, window: int | None, last_success_at: datetime | None, since: datetime | None
) -> datetime | None:
    """Return when a schedule becomes overdue unless a run succeeds first; None: never.

    ``window``: its ``alert_after`` or cadence; ``since``: when it was last
    started afresh (``owed_since``).
    """
    if window is None:
        return None
    first = timing.next_slot(schedule_timing, after=since - _TICK) if since is not None else None
    bases = [moment for moment in (last_success_at, first) if moment is not None]
    return max(bases) + timedelta(seconds=window) if bases else None

"""Which due slots of a schedule run and which are recorded as missed (pure).

Given where a schedule stands (``next_run_at``) and the database clock, the
leader expands the slots that came due since, splits them by the catch-up
window and the misfire policy, and says where ``next_run_at`` moves to.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler import timing

#: Slots exactly at a bound must be included; ``slots_between`` excludes ``since``.
_EPSILON = timedelta(microseconds=1)
#: How many overflowing missed slots are counted before we stop counting.
_MISSED_COUNT_CAP = 100_000


@dataclass(frozen=True)
class FirePlan:
    """The outcome of one schedule's due slots in one tick."""

    #: Slots to run now, oldest first.
    run: tuple[datetime, ...]
    #: Slots to record as ``missed``, oldest first (at most ``max_missed_rows``).
    missed: tuple[datetime, ...]
    #: Further missed slots not recorded as rows (only counted).
    missed_not_recorded: int
    #: Where the schedule's ``next_run_at`` moves to; ``None`` means no more slots.
    next_run_at: datetime | None


def plan_due(
    spec: timing.Timing,
    *,
    next_run_at: datetime,
    now: datetime,
    catchup_window: int,
    misfire: str,
    runs_so_far: int = 0,
    max_slots: int = 1000,
    max_missed_rows: int = 100,
    on_time_grace: float = 2.0,
) -> FirePlan:
    """Split the slots in ``[next_run_at, now]`` into those to run and those missed.

    Slots older than ``now - catchup_window`` are missed whatever the policy.
    Within the window, ``run_all`` runs every slot, ``run_once`` only the
    latest, and ``skip`` only a slot that is on time (within
    ``on_time_grace`` seconds). At most ``max_slots`` live slots are handled
    per call; ``next_run_at`` then points at the first one left, so the next
    tick carries on where this one stopped.
    """
    cutoff = now - timedelta(seconds=catchup_window)
    missed: list[datetime] = []
    missed_not_recorded = 0

    if next_run_at < cutoff:
        old = timing.slots_between(
            spec, since=next_run_at - _EPSILON, until=cutoff - _EPSILON,
            runs_so_far=runs_so_far, limit=max_missed_rows + _MISSED_COUNT_CAP,
        )
        missed = old[:max_missed_rows]
        missed_not_recorded = len(old) - len(missed)
        live_since = cutoff - _EPSILON
    else:
        live_since = next_run_at - _EPSILON

    live = timing.slots_between(spec, since=live_since, until=now, runs_so_far=runs_so_far, limit=max_slots)
    truncated = len(live) == max_slots
    last_handled = live[-1] if live else None

    late: list[datetime] = []
    if misfire != "run_all" and live:
        if truncated:
            # More slots than one call handles: none of these is the latest.
            late, live = live, []
        elif misfire == "run_once":
            late, live = live[:-1], live[-1:]
        else:  # skip: only a slot that is on time runs
            on_time = now - timedelta(seconds=on_time_grace)
            keep = live[-1:] if live[-1] >= on_time else []
            late, live = live[: len(live) - len(keep)], keep
    room = max(max_missed_rows - len(missed), 0)
    missed.extend(late[:room])
    missed_not_recorded += len(late) - min(len(late), room)

    runs_after = runs_so_far + len(live)
    if truncated and last_handled is not None:
        following = timing.next_slot(spec, after=last_handled, runs_so_far=runs_after)
    else:
        following = timing.next_slot(spec, after=now, runs_so_far=runs_after)
    return FirePlan(tuple(live), tuple(missed), missed_not_recorded, following)


def retry_delay(attempt: int, *, base: float, cap: float, spread: float) -> float:
    """Return the seconds to wait before the attempt after ``attempt`` (1 = the first run).

    Exponential: ``base * 2 ** (attempt - 1)``, plus up to half of that again
    as jitter (``spread`` in [0, 1), random in production) so that executions
    failing together do not retry in lockstep. Each delay is longer than the
    one before it, whatever the jitter; none is longer than ``cap``.
    """
    step = base * 2 ** (attempt - 1)
    return min(step * (1 + spread / 2), cap)

"""Scheduling policies as pure functions: catch-up, misfire, overlap, jitter, retry backoff.

Given where a schedule stands (``next_run_at``) and the database clock, the
leader expands the slots that came due since, splits them by the catch-up
window and the misfire policy, and says where ``next_run_at`` moves to; the
overlap policy and then ``max_runs`` decide which of the slots to run are sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from scheduler import timing

#: Slots exactly at a bound must be included; ``slots_between`` excludes ``since``.
_EPSILON = timedelta(microseconds=1)
#: Missed cron slots walked, past the recorded ones, before the rest of the
#: backlog is counted at their rate (``timing.count_slots``).
_COUNT_WALK = 100


@dataclass(frozen=True)
class FirePlan:
    """The outcome of one schedule's due slots in one tick, before overlap and ``max_runs``."""

    #: Slots the misfire policy runs, oldest first.
    run: tuple[datetime, ...]
    #: Slots to record as ``missed``, oldest first (at most ``max_missed_rows``).
    missed: tuple[datetime, ...]
    #: Further missed slots not recorded as rows (only counted).
    missed_not_recorded: int
    #: Where the schedule's ``next_run_at`` moves to; ``None`` means no more slots.
    next_run_at: datetime | None
    #: Slots computed one by one to make this plan; bounded however far behind.
    cost: int = 0


#: How late a slot may be and still be on time, for ``misfire=skip`` (seconds).
ON_TIME_GRACE_SECONDS = 2.0


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
    on_time_grace: float = ON_TIME_GRACE_SECONDS,
) -> FirePlan:
    """Split the slots in ``[next_run_at, now]`` into those to run and those missed.

    Slots older than ``now - catchup_window`` are missed whatever the policy:
    the first ``max_missed_rows`` are listed, the rest only counted, and the
    walk then jumps to the window, so a schedule days behind costs about as
    much as one an hour behind. Within the window, ``run_all`` runs every
    slot, ``run_once`` only the latest, and ``skip`` only a slot that is on
    time (within ``on_time_grace`` seconds). At most ``max_slots`` live
    slots are handled per call; ``next_run_at`` then points at the first one
    left, so the next tick carries on where this one stopped.

    ``max_runs`` is not applied here but after the overlap policy
    (``cap_runs``); ``runs_so_far`` only tells whether a one-off was sent.
    """
    if spec.max_runs is not None:  # replace() validates the whole timing again: only when there is a cap
        spec = replace(spec, max_runs=None)
    cutoff = now - timedelta(seconds=catchup_window)
    missed: list[datetime] = []
    missed_not_recorded = 0
    cost = 0

    if next_run_at < cutoff:
        old_since, old_until = next_run_at - _EPSILON, cutoff - _EPSILON
        missed = timing.slots_between(
            spec, since=old_since, until=old_until, runs_so_far=runs_so_far, limit=max_missed_rows
        )
        cost += len(missed)
        if len(missed) == max_missed_rows and spec.run_at is None:
            missed_not_recorded = timing.count_slots(
                spec, since=missed[-1] if missed else old_since, until=old_until, walk=_COUNT_WALK
            )
            cost += 0 if spec.interval is not None else min(missed_not_recorded, _COUNT_WALK)
        live_since = old_until
    else:
        live_since = next_run_at - _EPSILON

    live = timing.slots_between(spec, since=live_since, until=now, runs_so_far=runs_so_far, limit=max_slots)
    cost += len(live) + 1  # and the following slot below
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
    return FirePlan(tuple(live), tuple(missed), missed_not_recorded, following, cost)


def retry_delay(attempt: int, *, base: float, cap: float, spread: float) -> float:
    """Return the seconds to wait before the attempt after ``attempt`` (1 = the first run).

    Exponential: ``base * 2 ** (attempt - 1)``, plus up to half of that again
    as jitter (``spread`` in [0, 1), random in production) so that executions
    failing together do not retry in lockstep. Each delay is longer than the
    one before it, whatever the jitter; none is longer than ``cap``.
    """
    step = base * 2 ** (attempt - 1)
    return min(step * (1 + spread / 2), cap)


@dataclass(frozen=True)
class OverlapPlan:
    """What the overlap policy makes of one schedule's slots due in one tick."""

    #: Slots to send now.
    run: tuple[datetime, ...]
    #: A slot recorded ``pending`` but held back until nothing else is in flight.
    buffered: datetime | None
    #: Slots recorded ``skipped``.
    skipped: tuple[datetime, ...]
    #: Whether the executions in flight are to be cancelled first.
    cancel_in_flight: bool = False


def plan_overlap(policy: str, slots: Sequence[datetime], *, in_flight: int, buffered: int) -> OverlapPlan:
    """Apply an overlap policy to ``slots`` (oldest first) given what is already in flight.

    ``in_flight`` counts the schedule's unfinished executions (``buffered``
    of them held back by ``buffer_one``). A slot sent in this tick counts as
    in flight for the slots after it.
    """
    slots = tuple(slots)
    if not slots or policy == "allow":
        return OverlapPlan(run=slots, buffered=None, skipped=())
    if policy == "cancel_previous":
        return OverlapPlan(run=slots[-1:], buffered=None, skipped=slots[:-1], cancel_in_flight=in_flight > 0)
    run: tuple[datetime, ...]
    if in_flight:
        run, waiting = (), slots
    else:
        run, waiting = slots[:1], slots[1:]
    if policy == "buffer_one" and waiting and not buffered:
        return OverlapPlan(run=run, buffered=waiting[0], skipped=waiting[1:])
    if policy in ("skip", "buffer_one"):
        return OverlapPlan(run=run, buffered=None, skipped=waiting)
    raise ValueError(f"Unknown overlap policy: {policy!r}")


def cap_runs(plan: OverlapPlan, *, max_runs: int | None, committed: int) -> tuple[OverlapPlan, bool]:
    """Keep what fits in ``max_runs`` after ``committed`` runs; return it and whether the runs are used up.

    Applied after the misfire and overlap policies. A slot counts when it is
    recorded to run (sent now, or buffered by ``buffer_one``); a skipped or
    missed one never does. The schedule ends with its last run: slots after
    that one are dropped, not recorded.
    """
    if max_runs is None:
        return plan, False
    left = max(max_runs - committed, 0)
    counted = [*plan.run, *([plan.buffered] if plan.buffered is not None else [])]
    if len(counted) < left:
        return plan, False
    if left == 0:
        return OverlapPlan(run=(), buffered=None, skipped=()), True
    last = counted[left - 1]
    return OverlapPlan(
        run=tuple(slot for slot in plan.run if slot <= last),
        buffered=plan.buffered if plan.buffered is not None and plan.buffered <= last else None,
        skipped=tuple(slot for slot in plan.skipped if slot < last),
        cancel_in_flight=plan.cancel_in_flight,
    ), True


def jitter_offset(schedule_id: int, slot: datetime, jitter: int | None) -> float:
    """Return the delay in [0, ``jitter``) seconds for this (schedule, slot).

    Derived from a hash of both, so every leader computes the same delay for
    a slot and the delays of many schedules spread evenly.
    """
    if not jitter:
        return 0.0
    digest = hashlib.sha256(f"{schedule_id}:{slot.isoformat()}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return round(fraction * jitter, 3)

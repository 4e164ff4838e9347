"""Backfill: one Execution per past slot of a schedule in a range, sent at a bounded rate.

Each slot gets the key the beat uses (``executions.key``), so a slot
that already has an execution (fired by the beat, or by an earlier backfill)
is left alone, and running the same backfill twice creates nothing. Rows are
recorded and sent batch by batch: the beat leader publishes every ``pending``
row it sees, so recording them all up front would let it bypass ``rate``.

When the broker is unreachable the rows are still recorded, ``pending``, and
the beat leader sends them once it is back (the outbox). Under a ``rate`` the
run stops after the batch that failed instead, so the leader cannot send the
rest faster than asked; running the backfill again records them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from celery import current_app

from scheduler import outbox, timing
from scheduler.conf import settings
from scheduler.exceptions import BackfillRefused, BackfillTooLarge, BrokerUnavailable, ScheduleInvalid, first_line
from scheduler.models import Execution, Schedule
from scheduler.owners import executions

if TYPE_CHECKING:
    from celery import Celery

#: Most slots one backfill covers unless the caller allows more, up to the cap
#: (``SCHEDULER_BACKFILL_MAX_SLOTS``, or the call's ``max_slots``).
DEFAULT_LIMIT = 1000
#: Slots recorded and sent per batch (fewer under a low ``rate``).
BATCH_SIZE = 500
#: Counting the slots of an over-limit range stops here.
COUNT_CAP = 100_000
#: ``progress`` is called each time about this many more slots are done.
PROGRESS_EVERY = 1000
#: Keys looked up per query.
_KEYS_PER_QUERY = 1000
#: Slots exactly at ``start`` count; ``slots_between`` excludes its lower bound.
_TICK = timedelta(microseconds=1)


@dataclass(frozen=True)
class SlotState:
    """One slot of the range, and the execution it already had, if any."""

    scheduled_for: datetime
    execution_id: int | None = None
    #: Status of that execution; empty when the slot had none.
    status: str = ""


@dataclass(frozen=True)
class BackfillReport:
    """What a backfill recorded and sent (with ``dry_run``: what it would record)."""

    schedule: str
    start: datetime
    end: datetime
    dry_run: bool
    slots: tuple[SlotState, ...]
    #: Executions this backfill recorded.
    created: int
    #: Slots that already had an execution, left alone.
    already_present: int
    #: Executions sent to the broker.
    published: int
    #: Why sending stopped; the executions recorded but not sent stay ``pending``.
    broker_error: str = ""
    #: Slots not recorded because sending failed under a ``rate``.
    not_recorded: int = 0

    @property
    def outcome(self) -> dict[str, int | str]:
        """Return what it did, for its audit event: executions recorded and sent, slots left alone or not recorded."""
        counts: dict[str, int | str] = {
            "created": self.created,
            "already_present": self.already_present,
            "published": self.published,
            "not_recorded": self.not_recorded,
        }
        return {**counts, "broker_error": self.broker_error} if self.broker_error else counts


def existing(schedule: Schedule, slots: Iterable[datetime]) -> dict[datetime, tuple[int, str]]:
    """Return {slot: (execution id, status)} for the slots of ``schedule`` that have an execution."""
    by_key = {executions.key(schedule, slot): slot for slot in slots}
    keys = list(by_key)
    found: dict[datetime, tuple[int, str]] = {}
    for index in range(0, len(keys), _KEYS_PER_QUERY):
        rows = Execution.objects.filter(idempotency_key__in=keys[index : index + _KEYS_PER_QUERY])
        for key, pk, status in rows.values_list("idempotency_key", "id", "status"):
            found[by_key[key]] = (pk, status)
    return found


def slots_in_range(
    schedule: Schedule, *, start: datetime, end: datetime, now: datetime, limit: int, max_slots: int | None = None
) -> list[datetime]:
    """Return the slots of ``schedule`` in [``start``, ``end``]; raise ``BackfillRefused`` when that is not allowed.

    Refused: an empty or reversed range, an ``end`` later than ``now`` (only
    past slots are backfilled; the beat owns the future), an invalid timing,
    and (``BackfillTooLarge``) more than ``limit`` slots or more than the cap,
    ``max_slots`` or else ``SCHEDULER_BACKFILL_MAX_SLOTS``, whichever is lower
    (the message says how many there are).
    """
    cap = settings.BACKFILL_MAX_SLOTS if max_slots is None else max_slots
    bound = min(limit, cap)
    if end <= start:
        raise BackfillRefused(f"end ({end.isoformat()}) must be after start ({start.isoformat()})")
    if end > now:
        raise BackfillRefused(
            f"end ({end.isoformat()}) is later than now ({now.isoformat()}); only past slots can be backfilled"
        )
    try:
        spec = schedule.timing
        slots = timing.slots_between(spec, since=start - _TICK, until=end, limit=bound + 1)
        if len(slots) <= bound:
            return slots
        total = len(timing.slots_between(spec, since=start - _TICK, until=end, limit=COUNT_CAP + 1))
    except ScheduleInvalid as exc:
        raise BackfillRefused(f"schedule {schedule.name!r} has an invalid timing: {exc}") from None
    count = f"more than {COUNT_CAP:,}" if total > COUNT_CAP else f"{total:,}"
    if cap <= limit:
        source = "SCHEDULER_BACKFILL_MAX_SLOTS" if max_slots is None else "max_slots of this call"
        raise BackfillTooLarge(
            f"the range holds {count} slots, more than the {cap:,} one backfill may record ({source}); "
            "narrow the range",
            capped=True,
        )
    raise BackfillTooLarge(
        f"the range holds {count} slots, more than the limit of {limit:,}; narrow the range or raise the limit"
    )


def backfill(
    schedule: Schedule,
    *,
    start: datetime,
    end: datetime,
    now: datetime,
    dry_run: bool = False,
    limit: int = DEFAULT_LIMIT,
    max_slots: int | None = None,
    rate: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    app: Celery | None = None,
    on_start: Callable[[], None] | None = None,
) -> BackfillReport:
    """Record and send one execution per slot of ``schedule`` in [``start``, ``end``] that has none.

    ``now`` is the database clock. At most ``rate`` executions are sent per
    second when given; ``progress(done, total)`` is called about every
    ``PROGRESS_EVERY`` slots. After a broker error nothing more is sent: the
    rows are recorded ``pending`` for the beat leader to send (under a
    ``rate``, recording stops after that batch too), and the report says so.
    ``on_start()`` is called once the range is accepted, before the first
    execution is recorded (never on a dry run): the caller's audit event is
    committed there, so a crash part-way still leaves it.

    At most ``limit`` slots, and never more than the cap: ``max_slots`` when
    the caller raises it for this call, else ``SCHEDULER_BACKFILL_MAX_SLOTS``.
    A larger range is refused before anything is written.
    """
    slots = slots_in_range(schedule, start=start, end=end, now=now, limit=limit, max_slots=max_slots)
    present = existing(schedule, slots)
    states = tuple(SlotState(slot, *present.get(slot, (None, ""))) for slot in slots)
    report = BackfillReport(
        schedule=schedule.name,
        start=start,
        end=end,
        dry_run=dry_run,
        slots=states,
        created=0,
        already_present=len(present),
        published=0,
    )
    if dry_run:
        return report
    if on_start:
        on_start()
    app = app or current_app
    missing = [state.scheduled_for for state in states if state.execution_id is None]
    batch = BATCH_SIZE if rate is None else max(1, min(BATCH_SIZE, int(rate)))
    created = published = done = 0
    broker_error = ""
    started = time.monotonic()
    for index in range(0, len(missing), batch):
        if broker_error and rate:
            break
        rows = executions.record_slots(
            schedule,
            [(slot, Execution.Status.PENDING) for slot in missing[index : index + batch]],
            now=now,
            trigger=Execution.Trigger.BACKFILL,
        )
        created += len(rows)
        done = min(index + batch, len(missing))
        if not broker_error:
            try:
                published += len(outbox.publish(app, rows, now=now + timedelta(seconds=time.monotonic() - started)))
            except BrokerUnavailable as exc:
                broker_error = first_line(exc)
        if progress and done // PROGRESS_EVERY > index // PROGRESS_EVERY:
            progress(done, len(missing))
        if rate and not broker_error and done < len(missing):
            # Paced on the total so far: each batch waits until the average is back under ``rate``.
            time.sleep(max(published / rate - (time.monotonic() - started), 0.0))
    not_recorded = len(missing) - done
    return BackfillReport(
        schedule=schedule.name,
        start=start,
        end=end,
        dry_run=False,
        slots=states,
        created=created,
        already_present=len(slots) - created - not_recorded,
        published=published,
        broker_error=broker_error,
        not_recorded=not_recorded,
    )

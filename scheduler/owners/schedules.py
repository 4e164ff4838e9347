"""The one writer of Schedule rows: creation, edits, pauses, the leader's advance, run counts and repairs.

Nothing else in the project writes a schedule row (``tests/unit/test_row_owners.py``
fails on a write anywhere else), so what a write guarantees is stated once,
here:

- Another process changes a saved schedule all the time (the leader moves
  ``next_run_at`` and ``slots_committed``, workers count runs), so an edit writes
  only the fields that changed since the object was loaded, and counters
  only ever move by ``F()`` expressions: nothing read earlier is written back.
- An edit of the timing, the state or ``alert_after`` recomputes
  ``next_run_at``, ``cadence`` and ``overdue_at`` under the row's lock (the
  leader skips a locked row, a worker waits), from counters read under that
  lock; starting a schedule afresh moves ``owed_since``. "Now" is the
  database's clock unless the caller passes one: every replica agrees on it.
- A pause writes the same thing whoever pauses (an operator, the circuit
  breaker, the leader on an invalid timing): ``pausing``.
- Lock order: schedule row first, then its executions (``scheduler.owners.executions``).
- A write that gives a schedule a next slot wakes the beat leader when it
  commits (``_wake_the_beat``, PostgreSQL), so a slot sooner than the
  leader's next look fires on time.
- The leader commits an interval or one-off schedule's next slot a moment
  before its instant (``SCHEDULER_COMMIT_AHEAD_SECONDS``). Every edit,
  pause, turn-off, circuit breaker trip and delete first gives such a slot
  back (``give_back_ahead``): the slot runs as the schedule is after the
  edit, never as it was before it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connections, models, router, transaction
from django.db.models import BooleanField, Case, CharField, DateTimeField, F, Func, Q, TextField, Value, When
from django.db.models.functions import Cast, Coalesce, Concat, Now

from scheduler import dbclock, limits, shards, timing
from scheduler.beat import liveness
from scheduler.models import Execution, Schedule
from scheduler.models.lookups import AnyOf
from scheduler.models.schedule import DEADLINE_FIELDS, OWED_FIELDS
from scheduler.owners import executions
from scheduler.timing import overdue

logger = logging.getLogger(__name__)


# --- creation and edits -----------------------------------------------------------------


def create(*, now: datetime | None = None, **fields: Any) -> Schedule:
    """Insert a schedule with ``fields``; return it."""
    schedule = Schedule(**fields)
    save(schedule, now=now)
    return schedule


def save(schedule: Schedule, *, now: datetime | None = None, fields: Iterable[str] | None = None) -> None:
    """Insert ``schedule``, or write its edit: only ``fields`` (default: those changed since it was loaded).

    A timing or state change recomputes ``next_run_at`` from ``now`` (the
    database clock by default) under the row lock.
    """
    if schedule.enabled and schedule.disabled_reason:
        schedule.disabled_reason = ""  # enabled again by hand
    now = now or dbclock.now()
    if schedule._state.adding:
        _insert(schedule, now=now)
    else:
        changed = schedule.changed_fields()
        written = changed if fields is None else {*fields, *(changed & {"disabled_reason"})}
        if timing.is_hashed(schedule.cron) and written & changed & {"name", "tenant"}:
            changed |= {"cron"}  # its H fields hash the tenant and name: renamed, its slots move
            written |= {"cron"}
        if written:
            with transaction.atomic(using=_db(schedule)):
                give_back_ahead([schedule.pk])
                if written & changed & set(DEADLINE_FIELDS):
                    written |= _follow_timing_change(schedule, written & changed, now=now)
                _write(schedule, {*written, "updated_at"})
    schedule.mark_saved()


def set_enabled(schedule: Schedule, enabled: bool, *, now: datetime | None = None) -> None:
    """Turn ``schedule`` on (from its next slot after ``now``) or off."""
    schedule.enabled = enabled
    save(schedule, now=now)


def retire(origin: str, *, keep: Collection[str], reason: str, now: datetime | None = None) -> list[str]:
    """Turn off, with ``reason``, the deployer's enabled schedules of ``origin`` not named in ``keep``; return their names."""
    gone = Schedule.objects.filter(tenant="", origin=origin, enabled=True).exclude(name__in=keep).order_by("pk")
    names = []
    for schedule in gone:
        schedule.enabled, schedule.disabled_reason = False, reason
        save(schedule, now=now)
        names.append(schedule.name)
    return names


def delete(schedule: Schedule) -> None:
    """Delete ``schedule`` (its executions stay, detached), its row locked first: ``ScheduleQuerySet.delete``."""
    with transaction.atomic(using=_db(schedule)):
        give_back_ahead([schedule.pk])
        Schedule.objects.filter(pk=schedule.pk).delete()
    schedule.pk = None  # as Django's delete leaves a deleted object


# --- pause and resume -------------------------------------------------------------------


def pausing(reason: str | models.Expression, *, when: Q | None = None) -> dict[str, Any]:
    """The fields a pause writes, for an UPDATE: the reason, and no next slot (a paused schedule fires nothing).

    With ``when``, only rows that match it are paused; the others keep both fields.
    """
    if when is None:
        return {"paused_reason": reason, "next_run_at": None}
    return {
        "paused_reason": Case(When(when, then=reason), default=F("paused_reason"), output_field=TextField()),
        "next_run_at": Case(
            When(when, then=Value(None, output_field=DateTimeField())),
            default=F("next_run_at"),
            output_field=DateTimeField(),
        ),
    }


def pause(schedule: Schedule, reason: str, *, now: datetime | None = None) -> None:
    """Stop firing, keeping history; slots that fall in the pause are not owed later.

    A reason longer than ``limits.PAUSED_REASON_MAX_CHARS`` raises
    ``ValidationError`` on ``paused_reason`` and changes nothing. A pause
    moves no instant, so ``now`` is unused; it is taken so that every state
    change has the same signature.
    """
    reason = reason.strip() or "Paused"
    problems = limits.text_problems(reason, limits.PAUSED_REASON_MAX_CHARS)
    if problems:
        raise ValidationError({"paused_reason": problems})
    fields = pausing(reason)
    for name, value in fields.items():
        setattr(schedule, name, value)
    with transaction.atomic(using=_db(schedule)):
        give_back_ahead([schedule.pk])
        _write(schedule, {*fields, "updated_at"})
    schedule.mark_saved(fields)


def pause_many(ids: list[int], reason: str) -> int:
    """Pause the schedules ``ids`` that are not paused yet, in one UPDATE; return how many it paused."""
    with transaction.atomic():
        give_back_ahead(ids)
        return Schedule.objects.filter(pk__in=ids, paused_reason="").update(**pausing(reason), updated_at=Now())


def disable_many(ids: list[int]) -> int:
    """Turn off the schedules ``ids`` that are on, in one UPDATE (an off schedule has no next slot); return how many."""
    with transaction.atomic():
        give_back_ahead(ids)
        return Schedule.objects.filter(pk__in=ids, enabled=True).update(
            enabled=False, next_run_at=None, updated_at=Now()
        )


def resume(schedule: Schedule, *, now: datetime | None = None) -> None:
    """Fire again from the next slot after ``now``; reset the circuit breaker's count."""
    schedule.paused_reason = ""
    schedule.consecutive_failures = 0
    save(schedule, fields={*schedule.changed_fields(), "consecutive_failures"}, now=now)


# --- the leader's pass ------------------------------------------------------------------


@dataclass(frozen=True)
class Advance:
    """What one dispatch commit writes to a due schedule; schedules with equal writes share one UPDATE."""

    next_run_at: datetime | None
    #: Slots sent now: ``slots_committed`` moves by F(), so a concurrent increment is never lost.
    sent: int = 0
    #: Slots missed now, added to ``total_missed`` the same way.
    missed: int = 0
    #: Set when the schedule turns itself off (no slots left).
    disabled_reason: str | None = None
    #: Set when its timing is invalid: the schedule is paused.
    paused_reason: str | None = None

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"next_run_at": self.next_run_at, "slots_committed": F("slots_committed") + self.sent}
        if self.missed:
            fields["total_missed"] = F("total_missed") + self.missed
        if self.disabled_reason is not None:
            fields.update(enabled=False, disabled_reason=self.disabled_reason)
        if self.paused_reason is not None:
            fields.update(pausing(self.paused_reason))
        return fields


def advance(advances: Mapping[Advance, Iterable[int]]) -> None:
    """Write each ``Advance`` to its schedules (by id), one UPDATE per distinct write.

    For the leader's fenced transaction, which holds these rows' locks and
    checked that they are still the ones it planned from.
    """
    for write, pks in advances.items():
        Schedule.objects.filter(AnyOf(F("pk"), list(pks))).update(**write.fields())


def give_back_ahead(ids: Collection[int]) -> None:
    """Undo the commits of the schedules ``ids`` made ahead of their slot's instant: the slot is theirs to plan again.

    For a transaction about to change these schedules. Their rows are locked
    first (lock order), then the rows ahead are deleted
    (``executions.withdraw_ahead``) and each schedule gets its slot back as
    ``next_run_at`` (unless it has none: it was paused or turned off) and
    one fewer ``slots_committed``. A one-off whose slot it was is on again:
    that commit turned it off, as its last slot, and every other writer
    gives the slot back before it writes.
    """
    if not ids:
        return
    list(Schedule.objects.select_for_update().filter(pk__in=list(ids)).order_by("pk").values_list("pk", flat=True))
    # A burst committed ahead mostly gives back one slot of one instant: one UPDATE per distinct write.
    writes: defaultdict[tuple[datetime, int], list[int]] = defaultdict(list)
    for pk, slot_and_count in executions.withdraw_ahead(ids).items():
        writes[slot_and_count].append(pk)
    for (slot, count), pks in writes.items():
        turned_off_by_it = Q(run_at=slot, enabled=False)
        Schedule.objects.filter(pk__in=pks).update(
            next_run_at=Case(
                When(turned_off_by_it, then=Value(slot)),
                When(next_run_at__isnull=True, then=None),
                default=Value(slot),
                output_field=DateTimeField(),
            ),
            enabled=Case(When(turned_off_by_it, then=Value(True)), default=F("enabled"), output_field=BooleanField()),
            disabled_reason=Case(
                When(turned_off_by_it, then=Value("")), default=F("disabled_reason"), output_field=TextField()
            ),
            slots_committed=F("slots_committed") - count,
        )


def give_back_committed_ahead(*, dispatcher: str) -> None:
    """Give back every slot the beat replica ``dispatcher`` committed ahead of its instant (it is stopping)."""
    with transaction.atomic():
        give_back_ahead(executions.committed_ahead_by(dispatcher))


# --- run counts and the circuit breaker -------------------------------------------------


def count_run(schedule_id: int, *, status: str, error: str, started_at: datetime | None) -> bool:
    """Count one final ``status`` on the schedule's run counters, in one UPDATE; trip its circuit breaker when due.

    Return whether this tripped it (paused the schedule).

    The counters move as ``F()`` expressions, so nothing read earlier can be
    written back stale; a caller that also writes the execution locks the
    schedule row first (lock order above).
    """
    succeeded = status == Execution.Status.SUCCEEDED
    fields: dict[str, Any] = {
        "last_status": status,
        "total_runs": F("total_runs") + 1,
        "consecutive_failures": Value(0) if succeeded else F("consecutive_failures") + 1,
        "updated_at": Now(),
    }
    if started_at is not None:  # an execution failed before it started leaves the last run as it was
        fields["last_run_at"] = started_at
    if succeeded:  # the dead man's switch: a success moves the overdue deadline forward, on the database clock
        fields.update(last_success_at=Now(), overdue_at=_SecondsAfter(Now(), Coalesce("alert_after", "cadence")))
    trips = Q(pause_after_failures__gt=0, pause_after_failures__lte=F("consecutive_failures") + 1, paused_reason="")
    if not succeeded:
        fields["last_error"] = error
        reason = Concat(
            Value("Paused after "),
            Cast(F("consecutive_failures") + 1, CharField()),
            Value(f" consecutive failures; last: {error}"),
            output_field=TextField(),
        )
        fields.update(pausing(reason, when=trips))
    schedule = Schedule.objects.filter(pk=schedule_id)
    tripped = not succeeded and schedule.filter(trips).exists()
    # (A transaction only to trip it: this UPDATE is on every guarded run's path.)
    with transaction.atomic() if tripped else nullcontext():
        if tripped:
            give_back_ahead([schedule_id])
        schedule.update(**fields)
    if tripped:
        paused = schedule.values_list("name", "paused_reason").first()
        if paused is not None:
            logger.warning(
                "schedule %s paused: %s", *paused, extra={"action": "schedule_paused", "schedule": paused[0]}
            )
    return tripped


# --- repairs ----------------------------------------------------------------------------


def follow_calendars(schedule: Schedule, *, now: datetime) -> None:
    """Recompute the next slot and the overdue deadline of ``schedule`` after one of its calendars changed."""
    with transaction.atomic(using=_db(schedule)):
        _write(schedule, _follow_timing_change(schedule, set(), now=now))


def fix_next_run_at(schedule: Schedule, *, was: datetime | None, to: datetime | None) -> bool:
    """Move an active schedule's ``next_run_at`` from ``was`` to ``to``; False if it changed meanwhile."""
    return bool(Schedule.objects.active().filter(pk=schedule.pk, next_run_at=was).update(next_run_at=to))


def add_missed(schedule_id: int, missed: int) -> None:
    """Count ``missed`` more slots in the schedule's ``total_missed``."""
    Schedule.objects.filter(pk=schedule_id).update(total_missed=F("total_missed") + missed)


def mark_pruned(marks: list[Schedule], *, batch_size: int) -> None:
    """Write the ``pruned_through`` of each of ``marks``: for the pruning transaction, which locked them and moves it only forward."""
    Schedule.objects.bulk_update(marks, ["pruned_through"], batch_size=batch_size)


def assign_shards(rows: models.QuerySet[Schedule] | None = None, *, count: int | None = None) -> int:
    """Move each schedule of ``rows`` (default: all) whose ``shard`` is not ``id % count`` into it; return how many moved.

    ``count`` defaults to ``SCHEDULER_SHARDS``.
    """
    home = F("id") % (shards.count() if count is None else count)
    return (Schedule.objects.all() if rows is None else rows).exclude(shard=home).update(shard=home)


# --- helpers ----------------------------------------------------------------------------


def _db(schedule: Schedule) -> str:
    return router.db_for_write(Schedule, instance=schedule)


def _write(schedule: Schedule, fields: set[str]) -> None:
    models.Model.save(schedule, update_fields=fields)
    if "next_run_at" in fields:
        _wake_the_beat(schedule)


def _wake_the_beat(schedule: Schedule) -> None:
    """Tell the beat replicas (PostgreSQL's NOTIFY, sent at commit) that ``schedule`` may fire before they look.

    The leader sleeps until the next slot it knows of; without this, a
    schedule created or moved to fire sooner would wait for its next tick,
    up to ``SCHEDULER_MAX_INTERVAL_SECONDS`` late. SQLite has no NOTIFY: there it does wait.
    """
    connection = connections[_db(schedule)]
    if connection.vendor != "postgresql" or schedule.next_run_at is None:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [liveness.RELEASE_CHANNEL, liveness.SCHEDULES_CHANGED])


def _insert(schedule: Schedule, *, now: datetime) -> None:
    schedule.owed_since = schedule.owed_since or now
    schedule.next_run_at = schedule.compute_next_run_at(now=now)
    _follow_deadline_change(schedule)
    models.Model.save(schedule, force_insert=True)
    home = shards.shard_of(schedule.pk)
    if home != schedule.shard:  # the id, and so the shard, is known only after the insert
        Schedule.objects.filter(pk=schedule.pk).update(shard=home)
        schedule.shard = home
    _wake_the_beat(schedule)


def _follow_timing_change(schedule: Schedule, changed: set[str], *, now: datetime) -> set[str]:
    """Recompute ``next_run_at`` and the overdue deadline (and move ``owed_since``); return the fields written."""
    locked = Schedule.objects.select_for_update().filter(pk=schedule.pk)
    fresh = locked.values_list("slots_committed", "last_success_at").first()
    if fresh is not None:
        if "slots_committed" not in changed:
            schedule.slots_committed = fresh[0]
            schedule.mark_saved({"slots_committed"})
        schedule.last_success_at = fresh[1]
        schedule.mark_saved({"last_success_at"})
    schedule.next_run_at = schedule.compute_next_run_at(now=now)
    restarted = (
        bool(changed & set(OWED_FIELDS))
        or ("paused_reason" in changed and not schedule.paused_reason)
        or ("enabled" in changed and schedule.enabled)
    )
    if restarted:
        schedule.owed_since = now
    _follow_deadline_change(schedule)
    return {"next_run_at", "cadence", "overdue_at", *(["owed_since"] if restarted else [])}


def _follow_deadline_change(schedule: Schedule) -> None:
    """Recompute ``cadence`` and ``overdue_at`` from the timing, ``alert_after`` and the last success."""
    schedule.cadence = overdue.cadence(schedule.timing, since=schedule.owed_since or schedule.created_at)
    schedule.overdue_at = overdue.deadline(
        schedule.timing,
        window=schedule.alert_after or schedule.cadence,
        last_success_at=schedule.last_success_at,
        since=schedule.owed_since or schedule.created_at,
    )


class _SecondsAfter(Func):
    """A datetime expression plus an integer expression of seconds (NULL seconds give NULL)."""

    arity = 2
    output_field = DateTimeField()

    def as_sql(
        self,
        compiler: Any,
        connection: Any,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, tuple[Any, ...]]:
        (moment, moment_params), (seconds, seconds_params) = (
            compiler.compile(expression) for expression in self.get_source_expressions()
        )
        if connection.vendor == "sqlite":
            # Django's own datetime arithmetic function on SQLite (microseconds on the right).
            sql = f"django_format_dtdelta('+', {moment}, ({seconds}) * 1000000)"
        else:
            sql = f"({moment} + make_interval(secs => {seconds}))"
        return sql, (*moment_params, *seconds_params)

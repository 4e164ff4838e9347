"""The leader's pass: plan the due slots, record them as Execution rows under the lease, advance the schedules.

The leader plans the due slots outside any transaction, then commits them
in short transactions that each re-check its lease. The rows are committed
``pending``; the outbox (``scheduler.outbox``) sends them after the commit,
and whoever leads next sends what a crash left unsent.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.db import DatabaseError, connection, transaction
from django.db.models import Count, F, Q, QuerySet

from scheduler import dbclock, session_limits, timing, tracing
from scheduler.conf import settings
from scheduler.exceptions import InFlightLocked, ScheduleInvalid
from scheduler.failpoints import failpoint
from scheduler.models import Execution, Schedule
from scheduler.models.lookups import AnyOf
from scheduler.owners import executions, leases, schedules, work_rules
from scheduler.timing import policies

logger = logging.getLogger(__name__)

#: Due schedules whose ``next_run_at`` is older than this are a backlog: each
#: pass serves the on-time ones first and then as much backlog as fits in
#: ``PLAN_BUDGET``, so a deep backlog never starves schedules that are on time.
BACKLOG_AFTER = timedelta(seconds=60)
#: Work a pass may spend on backlog schedules: slots computed one by one plus
#: execution rows to write (some 20 to 50 µs each), about half a second.
PLAN_BUDGET = 8_000
#: Execution rows one transaction writes at most (it always takes one schedule).
COMMIT_ROWS = 1_000
#: Why ``overlap=cancel_previous`` cancelled an execution.
CANCEL_PREVIOUS_ERROR = "Cancelled by overlap=cancel_previous: a newer slot started"
#: Once a lock wait of the leader's commit ran out, the longest each later wait of that pass may take
#: (seconds): the chunk is split to find the schedules that need the locked row, and the others rarely wait.
SPLIT_LOCK_WAIT_SECONDS = 0.05
#: All the lock waits of one pass, together, in leader lock waits (``session_limits.leader_lock_wait_seconds``):
#: past that, what is left of the pass waits for the next one.
PASS_LOCK_WAITS = 3
#: The least a leader sleeps after a pass that left due schedules because a row they need was locked (seconds):
#: it tries them again soon, without spinning.
LOCKED_RETRY_SECONDS = 0.25


@dataclass
class DispatchReport:
    """What one dispatch pass committed."""

    db_now: datetime
    #: Due schedules committed (advanced or turned off) by this pass.
    schedules: int = 0
    #: Whether due schedules were left for the next pass (a full batch, or backlog over budget).
    more: bool = False
    missed: int = 0
    missed_not_recorded: int = 0
    skipped: int = 0
    #: (schedule name, slot) of every fire committed to run, for logging.
    fired: list[tuple[str, datetime]] = field(default_factory=list)
    #: Celery task ids of executions cancelled by ``overlap=cancel_previous``;
    #: the caller revokes them once the transaction has committed.
    cancelled_task_ids: list[str] = field(default_factory=list)
    #: (schedule name, reason) of schedules that turned themselves off.
    completed: list[tuple[str, str]] = field(default_factory=list)
    #: Transactions committed, and the longest one (the lease row stays locked that long).
    transactions: int = 0
    longest_transaction_seconds: float = 0.0
    #: Due schedules left for the next pass because another transaction held a row
    #: their commit needed (a worker's, a publisher's, an operator's).
    locked: int = 0
    #: The instants of the slots committed ahead of them (``COMMIT_AHEAD_SECONDS``): the outbox sends each then.
    ahead: set[datetime] = field(default_factory=set)
    #: Whether a row was committed that is due now: the outbox sends it at once.
    due_now: bool = False

    def add(self, part: DispatchReport) -> None:
        """Count in this report what one of the pass's transactions committed (``part``)."""
        self.schedules += part.schedules
        self.missed += part.missed
        self.missed_not_recorded += part.missed_not_recorded
        self.skipped += part.skipped
        self.fired += part.fired
        self.cancelled_task_ids += part.cancelled_task_ids
        self.completed += part.completed
        self.locked += part.locked
        self.due_now = self.due_now or part.due_now
        self.ahead |= part.ahead


def _in_flight(schedules: list[Schedule]) -> dict[int, tuple[int, int]]:
    """Return {schedule id: (executions in flight, of which buffered)} for non-``allow`` schedules."""
    ids = [s.pk for s in schedules if s.overlap != Schedule.Overlap.ALLOW]
    if not ids:
        return {}
    rows = (
        Execution.objects.filter(schedule_id__in=ids, status__in=Execution.IN_FLIGHT_STATUSES)
        .values("schedule_id")
        .annotate(total=Count("id"), buffered_count=Count("id", filter=Q(buffered=True)))
    )
    return {row["schedule_id"]: (row["total"], row["buffered_count"]) for row in rows}


def _completion_reason(
    schedule: Schedule | _Slot, *, runs_used: int, sent: bool = True, skipped: bool = False, taken: bool = False
) -> str:
    if schedule.run_at is not None:
        slot = f"One-off: its slot at {schedule.run_at.isoformat()}"
        if sent:
            return f"{slot} has been dispatched"
        if taken:
            return f"{slot} already had an execution (a backfill over it); the beat sent none"
        if skipped:
            return f"{slot} was skipped (overlap={schedule.overlap}: an earlier run was in flight)"
        return f"{slot} was missed (older than the catch-up window when the leader got to it)"
    if schedule.max_runs and runs_used >= schedule.max_runs:
        return f"Used all {schedule.max_runs} runs (max_runs)"
    if schedule.end_at is not None:
        return f"Past its end at {schedule.end_at.isoformat()}"
    return "No more slots"


@dataclass(frozen=True)
class _Planned:
    """One due schedule as read outside the transaction, with its plan (``None``: invalid timing)."""

    schedule: Schedule
    plan: policies.FirePlan | None
    error: str = ""

    @property
    def pk(self) -> int:
        return self.schedule.pk

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def shard(self) -> int:
        return self.schedule.shard

    @property
    def read_as(self) -> tuple[datetime | None, int, int]:
        """What the commit finds unchanged before it writes: (``next_run_at``, ``slots_committed``, shard)."""
        return self.schedule.next_run_at, self.schedule.slots_committed, self.schedule.shard

    @property
    def rows(self) -> int:
        return len(self.plan.run) + len(self.plan.missed) if self.plan is not None else 0


@dataclass(frozen=True)
class _Slot:
    """A due schedule whose plan is one slot, its ``next_run_at``, sent: committed set-based (``_commit_slots``).

    What ``policies`` would plan for it, worked out from a few columns: an
    interval or one-off schedule that is on time, with ``overlap=allow``, no
    run cap, end or calendar (``_SET_BASED_COLUMNS``, ``_slot_of``).
    """

    pk: int
    name: str
    shard: int
    next_run_at: datetime
    slots_committed: int
    #: The slot after this one (``None``: a one-off, which turns itself off).
    following: datetime | None
    run_at: datetime | None
    #: As ``_completion_reason`` reads them off a schedule: what makes it one.
    overlap: ClassVar[str] = Schedule.Overlap.ALLOW
    max_runs: ClassVar[None] = None
    end_at: ClassVar[None] = None

    @property
    def read_as(self) -> tuple[datetime | None, int, int]:
        return self.next_run_at, self.slots_committed, self.shard

    rows = 1


#: Whether the leader commits ``_Slot`` plans set-based; else every due schedule takes the general path.
SET_BASED = True
#: The columns ``_slot_of`` decides from, in its arguments' order.
_SET_BASED_COLUMNS = (
    "pk",
    "name",
    "shard",
    "next_run_at",
    "slots_committed",
    "interval",
    "run_at",
    "overlap",
    "max_runs",
    "end_at",
    "exclude_calendars",
    "only_calendar",
    "catchup_window",
    "misfire",
    "timezone",
    "dst_gap",
    "dst_fold",
)
_NEXT_RUN_AT = _SET_BASED_COLUMNS.index("next_run_at")


def _slot_of(
    pk: int,
    name: str,
    shard: int,
    next_run_at: datetime,
    slots_committed: int,
    interval: int | None,
    run_at: datetime | None,
    overlap: str,
    max_runs: int | None,
    end_at: datetime | None,
    exclude_calendars: str,
    only_calendar: str,
    catchup_window: int,
    misfire: str,
    timezone: str,
    dst_gap: str,
    dst_fold: str,
    *,
    now: datetime,
) -> _Slot | None:
    """The set-based plan of a due schedule read as ``_SET_BASED_COLUMNS``; ``None``: it takes the general path.

    Only where ``policies.plan_due`` and ``plan_overlap`` plan exactly one
    slot, ``next_run_at``, to send: no slot older than the catch-up window,
    one slot due (an interval's next is after ``now``), and under
    ``misfire=skip`` one that is on time; and a valid timing (one in a zone
    gone from tzdata is paused by the general path).
    ``tests/integration/test_set_based_dispatch.py`` compares what both paths commit.
    """
    if (
        overlap != Schedule.Overlap.ALLOW
        or max_runs is not None
        or end_at is not None
        or exclude_calendars
        or only_calendar
        or next_run_at < now - timedelta(seconds=catchup_window)
        or (misfire == Schedule.Misfire.SKIP and next_run_at < now - timedelta(seconds=policies.ON_TIME_GRACE_SECONDS))
        or not timing.zone_is_valid(timezone, dst_gap, dst_fold)
    ):
        return None
    if interval is not None and run_at is None:
        following = next_run_at + timedelta(seconds=interval)
        return _Slot(pk, name, shard, next_run_at, slots_committed, following, None) if following > now else None
    if run_at is not None and interval is None and run_at == next_run_at and slots_committed == 0:
        return _Slot(pk, name, shard, next_run_at, slots_committed, None, run_at)
    return None


#: A due schedule as the pass plans it: one slot set-based, or by the general path.
_Due = _Planned | _Slot

#: What a dispatch pass commits under: the one beat lease (every schedule),
#: or {shard: its lease} for the shards this replica holds.
Fence = leases.LeaseHandle | Mapping[int, leases.LeaseHandle]


def dispatch_due(fence: Fence, *, batch_size: int | None = None) -> DispatchReport:
    """Commit Execution rows for the due slots and advance the schedules.

    The slots are planned outside any transaction, from due rows read
    without locks: up to ``batch_size`` schedules that are on time, then the
    oldest backlog ones while ``PLAN_BUDGET`` lasts. The plans are committed
    in transactions of at most ``COMMIT_ROWS`` rows, each of which first
    locks the lease row and checks that ``lease`` still holds it (raising
    ``LeaseLost`` otherwise, and then that transaction writes nothing), and
    writes a schedule only if its ``next_run_at`` and ``slots_committed`` are
    still what it was planned from; one that moved meanwhile (an operator's
    edit) is left for the next pass. Conflicting idempotency keys are
    ignored, so a slot that already has an execution is never recorded
    twice. The catch-up window, misfire, overlap and ``max_runs`` decide
    which slots are sent and which are recorded ``missed`` or ``skipped``;
    a schedule with no slots left turns itself off with a reason.

    Given shards (``{shard: lease}``), only their schedules are read, each
    transaction locks and checks the leases of the shards it writes for, and
    a schedule is written only while it is still in one of them.
    """
    batch_size = batch_size or settings.DISPATCH_BATCH_SIZE
    now = dbclock.now()
    shards = fence if isinstance(fence, Mapping) else None
    planned, more = _plan(now=now, batch_size=batch_size, shards=shards)
    report = DispatchReport(db_now=now, more=more)
    waits = _LockWaits()
    for chunk in _chunks(planned):
        _commit_unblocked(chunk, fence=fence, now=now, report=report, waits=waits)
    return report


class _LockWaits:
    """How long the lock waits of one pass may still take (PostgreSQL; SQLite's writer holds the whole database)."""

    def __init__(self) -> None:
        self.each = session_limits.leader_lock_wait_seconds()
        self.until = time.monotonic() + PASS_LOCK_WAITS * self.each

    def next(self) -> float | None:
        """Return the bound of the next transaction's lock waits, or ``None`` once the pass used them up."""
        left = self.until - time.monotonic()
        return min(self.each, left) if left > 0 else None

    def ran_out(self) -> None:
        """A wait ran out: the later ones of the pass only look for the rows that are locked."""
        self.each = min(self.each, SPLIT_LOCK_WAIT_SECONDS)


def _commit_unblocked(
    chunk: list[_Due], *, fence: Fence, now: datetime, report: DispatchReport, waits: _LockWaits
) -> None:
    """Commit ``chunk`` (``_commit``); leave for the next pass the schedules that need a row another transaction holds.

    The leader's transaction holds its lease row locked, so it must never
    wait on a process that may freeze (a worker inside its own ``atomic()``,
    a publisher holding its batch): followers pass a locked lease row by, so
    all dispatch would stop and nobody would take over. So:

    - a ``cancel_previous`` schedule whose in-flight execution another
      transaction holds is left out (``InFlightLocked``) and the rest is
      committed at once, without waiting;
    - every other lock wait is bounded (``session_limits.bound_lock_wait``:
      a tenth of the lease TTL); one that runs out rolls the chunk back, and
      the chunk is split in halves and tried again with short waits
      (``SPLIT_LOCK_WAIT_SECONDS``), down to the schedules that still wait,
      which are left. The pass's waits together stay under
      ``PASS_LOCK_WAITS`` such bounds; what is left then waits for the next pass.

    Either way the leader keeps its lease; the schedules left are counted
    in ``report.locked`` and tried again on the next tick.
    """
    parts = [chunk]
    while parts:
        part = parts.pop()
        wait = waits.next()
        if wait is None:  # this pass waited long enough: the rest waits for the next one
            report.locked += sum(len(left) for left in (part, *parts))
            _left_for_later((part, *parts), "this pass already waited its share for locks")
            return
        done = DispatchReport(db_now=report.db_now)
        started = time.monotonic()
        try:
            _commit(part, fence=fence, now=now, report=done, lock_wait=wait)
        except InFlightLocked as exc:
            locked = set(exc.schedule_ids)
            left, rest = _split_off(part, locked)
            report.locked += len(left)
            _left_for_later(
                [left], "another transaction holds an execution in flight that cancel_previous would cancel"
            )
            if rest:
                parts.append(rest)
            continue
        except DatabaseError as exc:
            if connection.vendor != "postgresql" or not session_limits.lock_wait_ended(exc):
                raise
            waits.ran_out()
            if len(part) == 1:
                report.locked += 1
                _left_for_later([part], "another transaction holds a row its commit needs")
            else:
                half = len(part) // 2
                parts += [part[half:], part[:half]]
            continue
        finally:
            report.transactions += 1
            report.longest_transaction_seconds = max(report.longest_transaction_seconds, time.monotonic() - started)
        report.add(done)


def _split_off(part: list[_Due], pks: set[int]) -> tuple[list[_Due], list[_Due]]:
    """Return the plans of the schedules ``pks`` and the others."""
    return [item for item in part if item.pk in pks], [item for item in part if item.pk not in pks]


def _left_for_later(parts: Sequence[list[_Due]], why: str) -> None:
    names = sorted(item.name for part in parts for item in part)
    if names:
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        logger.warning(
            "schedule(s) %s left for the next tick: %s",
            shown,
            why,
            extra={"action": "dispatch_left_locked", "schedules": names[:100]},
        )


def _plan(*, now: datetime, batch_size: int, shards: Collection[int] | None) -> tuple[list[_Due], bool]:
    """Plan the on-time due schedules, then backlog ones within budget; return them and whether more are due.

    The due schedules are read as a few columns first: those ``_slot_of``
    plans set-based are never read as models, the others are. The
    set-based read looks ``COMMIT_AHEAD_SECONDS`` ahead: an interval or
    one-off schedule due that soon is committed now (``_ahead_of``), so at its
    instant only its message is left to send; a schedule due that soon
    that needs the general path waits for its instant.
    """
    set_based = _set_based()
    until = now + timedelta(seconds=commit_ahead_seconds())
    due = Schedule.objects.due(now=until)
    # A schedule a pause rule holds is not planned: its slots wait, and when the
    # rule is lifted its catch-up window and misfire policy decide what runs.
    held = work_rules.held(work_rules.pauses_in_force(max_age=0))
    if held is not None:
        due = due.exclude(held)
    if shards is not None:
        due = due.filter(shard__in=sorted(shards))
    on_time, backlog = _on_time_and_backlog(due, cutoff=now - BACKLOG_AFTER, batch_size=batch_size)
    planned: list[_Due]
    waiting = 0  # read ahead of their instant, but only their instant may plan them
    if set_based:
        slots: dict[int, _Slot | None] = {}
        for row in on_time:
            slot = _slot_of(*row, now=now)
            if row[_NEXT_RUN_AT] > now and not _ahead_of(slot, until):
                waiting += 1
            else:
                slots[row[0]] = slot
        left = [pk for pk, slot in slots.items() if not slot]
        general = {schedule.pk: schedule for schedule in due.filter(pk__in=left)} if left else {}
        planned = [slot or _plan_one(general[pk], now=now) for pk, slot in slots.items() if slot or pk in general]
    else:
        planned = [_plan_one(schedule, now=now) for schedule in due.filter(pk__in=[row[0] for row in on_time])]
    spent = 0
    for schedule in backlog:
        if spent >= PLAN_BUDGET:
            break
        item = _plan_one(schedule, now=now)
        spent += 1 if item.plan is None else item.plan.cost + item.rows
        planned.append(item)
    # A full read that reached schedules waiting for their instant read every one due now.
    more = (
        (len(on_time) == batch_size and not waiting)
        or len(backlog) == batch_size
        or len(planned) < len(on_time) - waiting + len(backlog)
    )
    return planned, more


def _set_based() -> bool:
    """Whether this pass commits ``_Slot`` plans set-based (a traced commit parents each row's publish span: not then)."""
    return SET_BASED and not tracing.enabled()


def commit_ahead_seconds() -> float:
    """How long before its instant a pass commits a slot: ``COMMIT_AHEAD_SECONDS`` on the set-based path, else 0."""
    return settings.COMMIT_AHEAD_SECONDS if _set_based() else 0.0


def _ahead_of(slot: _Slot | None, until: datetime) -> bool:
    """Whether a schedule not due yet may be committed before its instant: one planned set-based.

    An interval schedule's next slot must be past ``until``, so a schedule
    has one slot ahead at most; a one-off has no next slot (it turns itself
    off, and a give-back turns it on again). The general path (overlap,
    caps, calendars) is decided at the instant.
    """
    return slot is not None and (slot.following is None or slot.following > until)


def _on_time_and_backlog(
    due: QuerySet[Schedule], *, cutoff: datetime, batch_size: int
) -> tuple[list[tuple[Any, ...]], list[Schedule]]:
    """Read up to ``batch_size`` on-time due schedules (as ``_SET_BASED_COLUMNS``) and as many backlog ones.

    The due set is earliest first, so when its earliest row is on time there
    is no backlog and one read finds the on-time ones: the common pass. Else
    each is read apart, so a backlog however deep never crowds out the
    schedules that are on time.
    """
    columns = list(due.values_list(*_SET_BASED_COLUMNS)[:batch_size])
    if not columns or columns[0][_NEXT_RUN_AT] >= cutoff:
        return columns, []
    on_time = list(due.filter(next_run_at__gte=cutoff).values_list(*_SET_BASED_COLUMNS)[:batch_size])
    return on_time, list(due.filter(next_run_at__lt=cutoff)[:batch_size])


def _plan_one(schedule: Schedule, *, now: datetime) -> _Planned:
    try:
        plan = policies.plan_due(
            schedule.timing,
            next_run_at=schedule.next_run_at,  # type: ignore[arg-type]  # due: selected by its next_run_at
            now=now,
            catchup_window=schedule.catchup_window,
            misfire=schedule.misfire,
            runs_so_far=schedule.slots_committed,
        )
    except ScheduleInvalid as exc:
        return _Planned(schedule, None, str(exc))
    return _Planned(schedule, plan)


def _chunks(planned: list[_Due]) -> Iterator[list[_Due]]:
    """Split the plans into groups of about ``COMMIT_ROWS`` execution rows (at least one schedule each)."""
    chunk: list[_Due] = []
    rows = 0
    for item in planned:
        size = item.rows
        if chunk and rows + size > COMMIT_ROWS:
            yield chunk
            chunk, rows = [], 0
        chunk.append(item)
        rows += size
    if chunk:
        yield chunk


def _lease_for(fence: Fence) -> Callable[[int], leases.LeaseHandle]:
    """Return shard -> the lease a schedule of that shard is committed under."""
    if isinstance(fence, Mapping):
        return fence.__getitem__
    return lambda shard: fence


@tracing.traced("scheduler.dispatch.commit", tracing.commit_attributes)
def _commit(
    chunk: list[_Due], *, fence: Fence, now: datetime, report: DispatchReport, lock_wait: float | None = None
) -> None:
    """Record one chunk of plans in one fenced transaction; skip schedules that moved since they were read.

    ``lock_wait`` bounds each lock wait of the transaction (PostgreSQL);
    see ``_commit_unblocked`` for what a wait that runs out means.
    """
    lease_for = _lease_for(fence)
    with transaction.atomic():
        if lock_wait is not None:
            session_limits.bound_lock_wait(lock_wait)
        failpoint("dispatch.commit.before_fence")
        # Sharded, only the leases of the shards in this chunk are locked: the
        # other shards' commits never wait on this one.
        leases.assert_held_many(sorted({lease_for(item.shard) for item in chunk}, key=lambda lease: lease.name))
        failpoint("dispatch.commit.after_fence")
        planned_from = {item.pk: item.read_as for item in chunk}
        # Locks the rows until commit (SQLite's write lock covers it there);
        # a row a worker holds right now is left for the next pass, and so
        # is one moved to another shard meanwhile (``manage.py shards --assign``).
        found = list(
            Schedule.objects.active()
            .filter(AnyOf(F("pk"), list(planned_from)))
            .select_for_update(skip_locked=True)
            .values_list("pk", "next_run_at", "slots_committed", "shard")
        )
        report.locked += len(planned_from) - len(found)  # (or turned off meanwhile)
        unchanged = {pk for pk, *state in found if planned_from[pk] == tuple(state)}
        chunk = [item for item in chunk if item.pk in unchanged]
        if not chunk:
            return
        report.schedules += len(chunk)
        # Schedules due together mostly write the same values (next slot, count
        # sent, completion reason): one UPDATE per distinct write, never one per
        # schedule nor bulk_update's CASE over every row.
        writes: defaultdict[schedules.Advance, list[int]] = defaultdict(list)
        _commit_slots([item for item in chunk if isinstance(item, _Slot)], lease_for, report, writes)
        _commit_planned(
            [item for item in chunk if isinstance(item, _Planned)], lease_for, now=now, report=report, writes=writes
        )
        schedules.advance(writes)


def _commit_slots(
    slots: list[_Slot],
    lease_for: Callable[[int], leases.LeaseHandle],
    report: DispatchReport,
    writes: defaultdict[schedules.Advance, list[int]],
) -> None:
    """Record each slot's row by one statement per lease (``executions.insert_next_slots``), and its schedule's write.

    Schedules due together mostly share their next slot: one UPDATE each.
    """
    by_lease: defaultdict[leases.LeaseHandle, list[_Slot]] = defaultdict(list)
    for item in slots:
        by_lease[lease_for(item.shard)].append(item)
    for lease, mine in by_lease.items():
        stored = executions.insert_next_slots(
            [item.pk for item in mine], token=lease.token, lease_name=lease.name, dispatcher=lease.holder
        )
        for item in mine:
            sent = int(item.pk in stored)
            if sent:
                report.fired.append((item.name, item.next_run_at))
                if item.next_run_at <= report.db_now:
                    report.due_now = True
                else:
                    report.ahead.add(item.next_run_at)
            # A slot that already had an execution (a backfill over it) was not sent, and is not counted.
            if item.following is None:
                reason = _completion_reason(item, runs_used=sent, sent=bool(sent), taken=not sent)
                report.completed.append((item.name, reason))
                writes[schedules.Advance(None, sent, 0, reason)].append(item.pk)
            else:
                writes[schedules.Advance(item.following, sent)].append(item.pk)


def _commit_planned(
    chunk: list[_Planned],
    lease_for: Callable[[int], leases.LeaseHandle],
    *,
    now: datetime,
    report: DispatchReport,
    writes: defaultdict[schedules.Advance, list[int]],
) -> None:
    """Record the rows the general path planned (policies, overlap, caps) and their schedules' writes."""
    if not chunk:
        return
    due = [item.schedule for item in chunk]
    in_flight = _in_flight(due)
    rows: list[Execution] = []
    to_cancel: list[int] = []
    recording: list[_Recording] = []
    for item in chunk:
        schedule, plan = item.schedule, item.plan
        if plan is None:
            # One broken schedule (e.g. a zone gone from tzdata) must not
            # block the others: pause it with the reason and move on.
            logger.error("schedule %s paused: %s", schedule.name, item.error, extra={"action": "schedule_invalid"})
            writes[schedules.Advance(schedule.next_run_at, paused_reason=f"Invalid timing: {item.error}")].append(
                schedule.pk
            )
            continue
        flying, waiting_buffered = in_flight.get(schedule.pk, (0, 0))
        wanted = policies.plan_overlap(schedule.overlap, plan.run, in_flight=flying, buffered=waiting_buffered)
        overlap, used_up = policies.cap_runs(wanted, max_runs=schedule.max_runs, committed=schedule.slots_committed)
        if overlap.cancel_in_flight:
            to_cancel.append(schedule.pk)
        lease = lease_for(schedule.shard)
        build = functools.partial(
            executions.execution_for,
            schedule,
            now=now,
            token=lease.token,
            lease_name=lease.name,
            dispatcher=lease.holder,
        )
        first = len(rows)
        rows += [build(slot, status=Execution.Status.MISSED) for slot in plan.missed]
        rows += [build(slot, status=Execution.Status.SKIPPED) for slot in overlap.skipped]
        rows += [build(slot, status=Execution.Status.PENDING) for slot in overlap.run]
        if overlap.buffered is not None:
            rows.append(build(overlap.buffered, status=Execution.Status.PENDING, buffered=True))
        recording.append(_Recording(schedule, plan, wanted, overlap, used_up, slice(first, len(rows))))
    report.cancelled_task_ids += executions.cancel_in_flight(to_cancel, reason=CANCEL_PREVIOUS_ERROR, now=now)
    stored = executions.insert(rows)
    # This commit is the parent of their publish spans.
    tracing.created(row for row in rows if row.idempotency_key in stored)
    # Usually every row is new; a slot that already had an execution (a
    # backfill over it) was not stored, and this commit neither sent nor missed it.
    every = len(stored) == len(rows)
    for recorded in recording:
        mine = None if every else [row for row in rows[recorded.rows] if row.idempotency_key in stored]
        writes[recorded.write(mine, report)].append(recorded.schedule.pk)


@dataclass(frozen=True)
class _Recording:
    """One schedule's rows in a commit: what it planned, and where its rows are in the insert."""

    schedule: Schedule
    plan: policies.FirePlan
    #: The overlap policy's plan before ``max_runs`` capped it, and after.
    wanted: policies.OverlapPlan
    overlap: policies.OverlapPlan
    used_up: bool
    rows: slice

    def write(self, stored: list[Execution] | None, report: DispatchReport) -> schedules.Advance:
        """Count what the insert stored of this schedule's rows (``None``: all of them); return its write.

        ``slots_committed`` and ``total_missed`` grow by the rows stored, never by
        a slot whose key the insert found taken: that slot was not sent (or
        missed) by the beat, so it does not count towards ``max_runs`` either.
        """
        schedule, plan, overlap = self.schedule, self.plan, self.overlap
        missed: Sequence[datetime]
        skipped: Sequence[datetime]
        run: Sequence[datetime]
        if stored is None:
            missed, skipped, run, buffered = plan.missed, overlap.skipped, overlap.run, overlap.buffered
        else:
            missed = [row.scheduled_for for row in stored if row.status == Execution.Status.MISSED]
            skipped = [row.scheduled_for for row in stored if row.status == Execution.Status.SKIPPED]
            run = [row.scheduled_for for row in stored if row.status == Execution.Status.PENDING and not row.buffered]
            buffered = next((row.scheduled_for for row in stored if row.buffered), None)
        report.fired += [(schedule.name, slot) for slot in run]
        report.missed += len(missed)
        report.missed_not_recorded += plan.missed_not_recorded
        report.skipped += len(skipped)
        missed_now = len(missed) + plan.missed_not_recorded
        if missed_now:
            logger.warning(
                "schedule %s: %d slot(s) older than its catch-up window (%ss) or skipped by "
                "misfire=%s recorded as missed, %d more not recorded",
                schedule.name,
                len(missed),
                schedule.catchup_window,
                schedule.misfire,
                plan.missed_not_recorded,
                extra={"action": "slots_missed", "schedule": schedule.name},
            )
        sent_now = len(run) + (buffered is not None)
        report.due_now = report.due_now or sent_now > 0
        meant = len(overlap.run) + (overlap.buffered is not None)
        next_run_at = plan.next_run_at
        if self.used_up and sent_now == meant:
            next_run_at = None  # capped by max_runs: that was its last run
        elif self.used_up:
            # A slot it meant to send was taken, so runs are left: from the first slot the cap dropped.
            dropped = sorted(_slots(self.wanted) - _slots(overlap))
            next_run_at = dropped[0] if dropped else plan.next_run_at
        disabled_reason = None
        if next_run_at is None:
            disabled_reason = _completion_reason(
                schedule,
                runs_used=schedule.slots_committed + sent_now,
                sent=sent_now > 0,
                skipped=bool(skipped),
                taken=sent_now < meant,
            )
            report.completed.append((schedule.name, disabled_reason))
        return schedules.Advance(next_run_at, sent_now, missed_now, disabled_reason)


def _slots(overlap: policies.OverlapPlan) -> set[datetime]:
    return {*overlap.run, *overlap.skipped, *([overlap.buffered] if overlap.buffered is not None else [])}

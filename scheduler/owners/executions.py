"""The one owner of an Execution's life: its key, its row, and every status change.

Every status change goes through ``_move``, which only applies a move that
``Execution.TRANSITIONS`` allows, so no caller can write an illegal one.

A worker that claims an execution gets a ``Claim``: the execution id and
the attempt number, which is the claim's fencing token. Every move that
hands the execution to a new holder (taking over an expired claim, a retry,
a lost attempt retried) increments ``attempt`` exactly once, through
``_NEXT_ATTEMPT``. Every later write by the holder (renew, finish, retry,
time out, release) matches on (execution id, attempt, ``running``), so a
holder whose claim moved on (it froze past it, another worker took over,
an operator cancelled) changes nothing.

Lock order: a transaction that writes both takes the schedule row first,
then the execution row, as the leader's dispatch does (it locks due
schedules, then cancels their executions), and a schedule's delete
(``scheduler.owners.schedules.delete``). The opposite order deadlocks on
PostgreSQL (issue 14, item 6).

Every move to a final status (and every row inserted final) is also
counted, by a database trigger in the same statement, into the tallies
``/metrics`` reads (``scheduler.models.tally``): no path here needs to.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, cast

from django.db import IntegrityError, connections, transaction
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    Exists,
    ExpressionWrapper,
    F,
    Field,
    Func,
    OuterRef,
    PositiveIntegerField,
    Q,
    QuerySet,
    Subquery,
    When,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now
from django.db.models.lookups import LessThan
from django.db.models.sql import InsertQuery, Query, UpdateQuery
from django.db.transaction import TransactionManagementError

from scheduler import dbclock, limits, session_limits, tracing
from scheduler.conf import settings
from scheduler.exceptions import InFlightLocked, MessageRefused
from scheduler.failpoints import failpoint
from scheduler.fastpath import bulk_insert, celery_result
from scheduler.fastpath.prepared import Param, Prepared, RowReader
from scheduler.models import Execution, Schedule
from scheduler.models.execution import ExecutionQuerySet
from scheduler.models.lookups import AnyOf, array_of
from scheduler.models.schedule import MESSAGE_OPTION_FIELDS
from scheduler.models.tally import MESSAGE_REFUSED, TallyIncrement
from scheduler.owners import notifications, schedules, work_rules

logger = logging.getLogger(__name__)

Status = Execution.Status

#: Execution columns a message is built from.
MESSAGE_FIELDS = ("id", "task", "args", "kwargs", "queue", "priority", "celery_task_id", "timeout", "scheduled_for")
#: The one place ``attempt`` grows: a new holder gets the next token.
_NEXT_ATTEMPT = F("attempt") + 1
#: Rows inserted or looked up per query.
_BATCH = 1000


# --- keys ------------------------------------------------------------------------------


def key(schedule: Schedule, slot: datetime) -> str:
    """Return the key that makes a (schedule, slot) fire at most once: ``schedule:<id>:<slot ISO>``."""
    return f"schedule:{schedule.pk}:{slot.astimezone(timezone.utc).isoformat()}"


def run_now_key(schedule: Schedule) -> str:
    """Return a fresh key for a manual run: it never takes the slot of a scheduled fire."""
    return f"schedule:{schedule.pk}:manual:{uuid.uuid4()}"


def retry_key(execution: Execution) -> str:
    """Return a fresh key for an operator's re-run of ``execution``."""
    return f"retry:{execution.pk}:{uuid.uuid4()}"


def submit_key() -> str:
    """Return a fresh key for a ``submit()`` without the caller's own key."""
    return f"submit:{uuid.uuid4()}"


def ad_hoc_key(celery_task_id: str) -> str:
    """Return the key of a task sent the plain Celery way: its redeliveries share it."""
    return f"celery:{celery_task_id}"


# --- building and recording -----------------------------------------------------------


def execution_for(
    schedule: Schedule,
    slot: datetime,
    *,
    status: str,
    now: datetime,
    token: int | None = None,
    lease_name: str = "",
    dispatcher: str = "",
    buffered: bool = False,
    trigger: str = Execution.Trigger.SCHEDULED,
) -> Execution:
    """Return an unsaved Execution of ``schedule`` for ``slot``.

    ``lease_name`` and ``token`` name the beat lease it is committed under,
    ``dispatcher`` the replica holding it; none for writes outside the beat.

    A ``pending`` one gets its Celery task id now, so a re-send reuses it;
    any other status is final and finished at ``now``.
    """
    sent = status == Status.PENDING
    return Execution(
        idempotency_key=key(schedule, slot),
        trigger=trigger,
        schedule=schedule,
        **_copied(schedule),
        scheduled_for=slot,
        status=status,
        buffered=buffered,
        lease_token=token,
        lease_name=lease_name,
        dispatcher=dispatcher,
        # Chosen before sending so a re-publish after a crash reuses the id.
        celery_task_id=str(uuid.uuid4()) if sent else "",
        finished_at=None if sent else now,
    )


def run_now_for(schedule: Schedule, *, now: datetime, overrides: Mapping[str, Any] | None = None) -> Execution:
    """Return an unsaved ``pending`` execution of ``schedule`` for ``now``, outside its timing.

    ``overrides`` (``operations.RUN_OVERRIDES``, checked by the caller)
    replace the schedule's values on this execution only.

    It is sent as soon as it commits, so it is stamped ``enqueued_at=now``
    already: an idle worker may claim it before its sender marks it
    ``queued``, and that mark then changes nothing. A send that fails leaves
    it ``pending``; the leader's send restamps it.
    """
    execution = execution_for(schedule, now, status=Status.PENDING, now=now, trigger=Execution.Trigger.MANUAL)
    execution.idempotency_key = run_now_key(schedule)
    execution.enqueued_at = now
    for field, value in (overrides or {}).items():
        setattr(execution, field, value)
    return execution


def retry_for(execution: Execution, *, now: datetime) -> Execution:
    """Return an unsaved ``pending`` execution that re-runs ``execution`` at ``now``, as attempt 1.

    Stamped ``enqueued_at=now``, as ``run_now_for`` is, for the same reason.
    """
    return Execution(
        idempotency_key=retry_key(execution),
        trigger=Execution.Trigger.RETRY,
        retry_of=execution,
        schedule_id=execution.schedule_id,
        **_copied(execution),
        scheduled_for=now,
        enqueued_at=now,
        celery_task_id=str(uuid.uuid4()),
    )


#: What an execution copies from its schedule, or a re-run from the execution it repeats.
_COPIED_FIELDS = ("task", "args", "kwargs", "queue", "priority", "tenant", "timeout", "max_retries", "retry_backoff")


def _copied(source: Schedule | Execution) -> dict[str, Any]:
    return {field: getattr(source, field) for field in _COPIED_FIELDS}


def insert(rows: list[Execution]) -> set[str]:
    """Insert ``rows``, ignoring any whose key exists: the database decides what fires once; return the keys stored.

    Only a taken ``idempotency_key`` is ignored; a row that breaks any other
    constraint raises ``IntegrityError``. The rows ``bulk_create(rows,
    ignore_conflicts=True)`` would write, without its per-row field
    preparation (``bulk_insert``): the leader's commit inserts thousands at
    a time.
    """
    return set(bulk_insert.insert_ignoring_conflicts(rows, key="idempotency_key", batch_size=_BATCH))


def insert_next_slots(schedule_ids: Sequence[int], *, token: int, lease_name: str, dispatcher: str) -> set[int]:
    """Insert, for each schedule, the ``pending`` execution of the slot its ``next_run_at`` names; return those stored.

    The rows ``execution_for(schedule, schedule.next_run_at, status=pending,
    ...)`` builds, written by one ``INSERT ... SELECT`` from the schedules'
    own rows: no schedule or execution is read into this process. A slot
    whose key is taken is left (``ON CONFLICT DO NOTHING``) and its schedule
    is not among those returned. For the leader's fenced commit, which holds
    these schedules locked and checked their ``next_run_at``.
    """
    if not schedule_ids:
        return set()
    connection = connections[Execution.objects.db]
    sql, sent = _next_slots_sql(connection.vendor)
    lease: dict[str, Any] = {"lease_token": token, "lease_name": lease_name, "dispatcher": dispatcher}
    params: list[Any] = [lease[value.name] if isinstance(value, _Lease) else value for value in sent]
    stored: set[int] = set()
    with connection.cursor() as cursor:
        for start in range(0, len(schedule_ids), _BATCH):
            ids = list(schedule_ids[start : start + _BATCH])
            id_params: list[Any]
            if connection.vendor == "postgresql":
                where, id_params = f"= ANY({array_of(Schedule._meta.pk, connection)})", [ids]
            else:
                where, id_params = f"IN ({', '.join(['%s'] * len(ids))})", ids
            cursor.execute(sql.format(ids=where), [*params, *id_params])
            stored.update(schedule_id for (schedule_id,) in cursor.fetchall())
    return stored


#: What a slot's row takes from its schedule's row, by Execution field: the slot is the schedule's ``next_run_at``.
_FROM_SCHEDULE = {**{name: name for name in _COPIED_FIELDS}, "schedule_id": "id", "scheduled_for": "next_run_at"}


@dataclass(frozen=True)
class _Lease:
    """A parameter that is the call's lease: its ``lease_token``, ``lease_name`` or ``dispatcher``."""

    name: str


@functools.lru_cache(maxsize=4)
def _next_slots_sql(vendor: str) -> tuple[str, tuple[Any, ...]]:
    """``insert_next_slots``'s statement (``{ids}`` to fill in) and its parameters before the ids.

    A parameter is the call's lease (``_Lease``) or a value every row takes
    alike: ``execution_for``'s for any schedule, a model default prepared by
    its field as the ORM would.
    """
    connection = connections[Execution.objects.db]
    quote = connection.ops.quote_name
    template = Execution(trigger=Execution.Trigger.SCHEDULED, status=Status.PENDING, buffered=False)
    now_sql, _ = Query(Execution).get_compiler(connection=connection).compile(Now())
    if vendor == "postgresql":
        slot = "s.next_run_at AT TIME ZONE 'UTC'"
        iso = (
            f"to_char({slot}, 'YYYY-MM-DD\"T\"HH24:MI:SS') || CASE WHEN date_part('microseconds', s.next_run_at)"
            f"::bigint %% 1000000 = 0 THEN '' ELSE to_char({slot}, '.US') END"
        )
        task_id = "gen_random_uuid()::text"
    else:  # SQLite keeps a datetime as UTC text, isoformat's with a space; a version 4 UUID from random bytes
        iso = "replace(s.next_run_at, ' ', 'T')"
        task_id = (
            "lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || substr(hex(randomblob(2)), 2) || '-'"
            " || substr('89ab', 1 + abs(random() %% 4), 1) || substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(6)))"
        )
    columns: list[str] = []
    values: list[str] = []
    sent: list[Any] = []
    for field in Execution._meta.concrete_fields:
        if field.primary_key:
            continue
        columns.append(quote(field.column))
        if field.attname in _FROM_SCHEDULE:
            values.append(f"s.{quote(cast(Field, Schedule._meta.get_field(_FROM_SCHEDULE[field.attname])).column)}")
        elif field.attname == "idempotency_key":
            values.append(f"'schedule:' || s.id || ':' || {iso} || '+00:00'")
        elif field.attname == "celery_task_id":
            values.append(task_id)
        elif getattr(field, "auto_now_add", False) or getattr(field, "auto_now", False):
            values.append(now_sql)
        elif field.attname in ("lease_token", "lease_name", "dispatcher"):
            values.append("%s")
            sent.append(_Lease(field.attname))
        else:
            values.append("%s")
            sent.append(field.get_db_prep_save(getattr(template, field.attname), connection))
    sql = (
        f"INSERT INTO {quote(Execution._meta.db_table)} ({', '.join(columns)}) "
        f"SELECT {', '.join(values)} FROM {quote(Schedule._meta.db_table)} s WHERE s.id {{ids}} "
        f"ON CONFLICT ({quote('idempotency_key')}) DO NOTHING RETURNING {quote('schedule_id')}"
    )
    return sql, tuple(sent)


def record_slots(
    schedule: Schedule,
    slots: Sequence[tuple[datetime, str]],
    *,
    now: datetime,
    trigger: str = Execution.Trigger.SCHEDULED,
) -> list[dict[str, Any]]:
    """Record an execution of ``schedule`` for each (slot, status) that has none yet; return the rows created.

    ``trigger`` is ``backfill`` for an operator's backfill; reconcile's repair
    records slots the beat owed, so they stay ``scheduled``.

    Runs under a lock on the schedule row, so two callers recording the same
    slots at once (backfill, reconcile's repair) create each row once and
    each reports only its own; the unique key stays the last word against
    anyone else (the beat).
    """
    with transaction.atomic():
        # Recorders of this schedule's slots take turns on its row.
        list(Schedule.objects.select_for_update().filter(pk=schedule.pk).values_list("pk", flat=True))
        return record(
            [execution_for(schedule, slot, status=status, now=now, trigger=trigger) for slot, status in slots]
        )


def record(rows: list[Execution]) -> list[dict[str, Any]]:
    """Insert the ``rows`` whose key has no execution yet; return those as ``message_rows``.

    Only the rows this call stored are returned (the insert's own
    ``RETURNING``): of two callers recording one key at once, one reports it.
    """
    stored = insert(rows)
    new_keys = [row.idempotency_key for row in rows if row.idempotency_key in stored]
    created: list[dict[str, Any]] = []
    for index in range(0, len(new_keys), _BATCH):
        created += message_rows(Execution.objects.filter(idempotency_key__in=new_keys[index : index + _BATCH]))
    return created


def record_one(execution: Execution) -> tuple[Execution, bool]:
    """Insert ``execution``; return it and True, or the execution that already has its key and False.

    What ``save()`` writes, but ``created_at`` is the database clock, as
    everywhere else in an execution's life: one ``INSERT ... RETURNING``
    stores it and sets the id and ``created_at`` on ``execution``.
    """
    try:
        with transaction.atomic():
            _insert_stamped(execution)
    except IntegrityError:
        existing = Execution.objects.filter(idempotency_key=execution.idempotency_key).first()
        if existing is None:  # the conflict was not the key: a real error
            raise
        return existing, False
    return execution, True


def _insert_stamped(execution: Execution) -> None:
    """Insert the unsaved ``execution`` with ``created_at`` from the database clock; set its id and ``created_at``."""
    using = Execution.objects.db
    # Django's private step of save() before an INSERT, not in the stubs.
    execution._prepare_related_fields_for_save(operation_name="save")  # type: ignore[attr-defined]  # noqa: SLF001
    execution.created_at = Now()  # compiled into the INSERT (raw: attribute values, no pre_save)
    try:
        query = InsertQuery(Execution)
        query.insert_values(_inserted(), [execution], raw=True)
        [(pk, created_at)] = query.get_compiler(using).execute_sql([Execution._meta.pk, _field("created_at")])
    except BaseException:
        execution.created_at = None  # type: ignore[assignment]  # unsaved again: the stubs type the saved row's value
        raise
    execution.pk, execution.created_at = pk, created_at
    execution._state.adding, execution._state.db = False, using


def record_ad_hoc(
    celery_task_id: str, *, task: str, args: Any, kwargs: Any, queue: str, timeout: int | None, now: datetime
) -> str:
    """Record a plain Celery call as a ``queued`` Execution keyed by its task id (once); return the key.

    What ``insert([row])`` writes, by a statement compiled once per process:
    a worker runs this for every such task. Its ``created_at`` and
    ``enqueued_at`` are the database clock, in the statement: like every
    ``queued`` row it says since when it waits, so reconcile and the
    leader's broker check send it again if no worker claims it (its worker
    died before the claim, or the broker lost the message).
    """
    _refuse_unrecordable(task, celery_task_id)
    row = _ad_hoc_row(celery_task_id, task=task, args=args, kwargs=kwargs, queue=queue, timeout=timeout, now=now)
    _AD_HOC.execute(Execution.objects.db, (False, 0), _ad_hoc_values(row, _AD_HOC_NOW))
    return row.idempotency_key


@tracing.traced("scheduler.claim", tracing.claiming_attributes, tracing.claimed_attributes)
def record_ad_hoc_claimed(
    celery_task_id: str,
    *,
    worker: str,
    task: str,
    args: Any,
    kwargs: Any,
    queue: str,
    timeout: int | None,
    now: datetime,
) -> Execution | None:
    """Record a plain Celery call already claimed by ``worker``, in one statement; return it as claimed.

    What ``record_ad_hoc`` and then ``claim`` write, in one round trip: the
    row is inserted ``running``, its claim running from the database clock.
    ``None``: its key exists (a redelivery, or a worker that recorded it
    first), and nothing was written: claim it by its key as usual. For the
    guard when no work rule is in force (the rules are asked between the
    record and the claim).
    """
    _refuse_unrecordable(task, celery_task_id)
    row = _ad_hoc_row(celery_task_id, task=task, args=args, kwargs=kwargs, queue=queue, timeout=timeout, now=now)
    row.status, row.worker = Status.RUNNING, worker
    values = _ad_hoc_values(row, {**_AD_HOC_NOW, **_CLAIMED_NOW})
    using = Execution.objects.db
    failpoint("worker.claim.before")
    found = _AD_HOC.execute(using, (True, settings.CLAIM_SECONDS), values)
    return None if found is None else _claimed(using, found)


def _ad_hoc_row(
    celery_task_id: str, *, task: str, args: Any, kwargs: Any, queue: str, timeout: int | None, now: datetime
) -> Execution:
    """The ``queued`` row of a plain Celery call, keyed by its task id (not saved)."""
    return Execution(
        idempotency_key=ad_hoc_key(celery_task_id),
        trigger=Execution.Trigger.SUBMIT,
        task=task,
        # (the call's record: the body gets the message's own arguments)
        args=limits.storable(list(args or ())),
        kwargs=limits.storable(dict(kwargs or {})),
        queue=queue,
        scheduled_for=now,
        status=Status.QUEUED,
        celery_task_id=celery_task_id,
        timeout=timeout,
    )


def _ad_hoc_values(row: Execution, filled: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``row``'s insert, but for the columns the statement fills in (``filled``)."""
    return {field.attname: getattr(row, field.attname) for field in _inserted() if field.attname not in filled}


def _inserted() -> list[Any]:
    """The columns an insert writes: every concrete one but the id."""
    return [field for field in Execution._meta.concrete_fields if not field.primary_key]


#: Columns of an ad-hoc row the database clock fills in: ``enqueued_at`` as the other writes of it
#: (``mark_resent`` matches it exactly), ``created_at`` as the other inserts (``insert``).
_AD_HOC_NOW: dict[str, Callable[[], Any]] = {"created_at": Now, "enqueued_at": lambda: _db_now_plus(0)}


#: Columns of an ad-hoc row inserted claimed that the database clock fills in, as ``claim`` writes them.
_CLAIMED_NOW: dict[str, Callable[[], Any]] = {"started_at": Now}


def _ad_hoc_sql(using: str, claimed: bool = False, claim_seconds: float = 0) -> tuple[str, list[Any]]:
    """One row's ``INSERT`` that skips a row whose key exists, every column a ``Param`` but ``_AD_HOC_NOW``.

    ``claimed``: the row goes in running (``started_at`` and ``claim_expires_at``
    from the database clock too) and comes back (``RETURNING``).
    """
    filled: dict[str, Callable[[], Any]] = dict(_AD_HOC_NOW)
    if claimed:
        filled.update(_CLAIMED_NOW, claim_expires_at=lambda: _db_now_plus(claim_seconds))
    template = Execution()
    for field in _inserted():
        now = filled.get(field.attname)
        setattr(template, field.attname, now() if now else Param(field.attname, field))
    query = InsertQuery(Execution)
    query.insert_values(_inserted(), [template], raw=True)  # raw: the values are the Params, not pre_save's
    [(sql, params)] = query.get_compiler(using).as_sql()
    # Only a taken key is skipped (not SQLite's INSERT OR IGNORE, which drops a row breaking any constraint).
    key = connections[using].ops.quote_name(Execution._meta.get_field("idempotency_key").column)
    returning = f" RETURNING {_ROW.columns(using)}" if claimed else ""
    return f"{sql} ON CONFLICT ({key}) DO NOTHING{returning}", list(params)


_AD_HOC = Prepared(_ad_hoc_sql)


# --- messages -------------------------------------------------------------------------


#: What a message takes from the execution's schedule: its jitter and Celery's message options.
SCHEDULE_MESSAGE_FIELDS = {name: F(f"schedule__{name}") for name in ("jitter", *MESSAGE_OPTION_FIELDS)}


def message_row(execution: Execution) -> dict[str, Any]:
    """Return what ``outbox.publish`` needs of one execution sent now: its schedule's message options, no jitter."""
    row = {field: getattr(execution, field) for field in MESSAGE_FIELDS}
    if execution.schedule_id is not None:
        row.update(Schedule.objects.filter(pk=execution.schedule_id).values(*MESSAGE_OPTION_FIELDS).first() or {})
    return row


def message_rows(executions: QuerySet[Execution]) -> list[dict[str, Any]]:
    """Return ``executions`` as the rows ``outbox.publish`` sends, with their status."""
    return list(
        executions.order_by("scheduled_for", "id").values(
            *MESSAGE_FIELDS, "schedule_id", "status", **SCHEDULE_MESSAGE_FIELDS
        )
    )


def _ahead_of_its_instant() -> Q:
    """A slot the leader committed before its instant (``COMMIT_AHEAD_SECONDS``): not sent before it."""
    return Q(
        trigger=Execution.Trigger.SCHEDULED,
        scheduled_for__gt=RawSQL(dbclock.now_sql(), [], output_field=DateTimeField()),
    )


def pending_rows(*, limit: int, locked: bool = False) -> tuple[list[dict[str, Any]], datetime | None]:
    """Return up to ``limit`` unsent, not buffered executions as ``message_rows``, oldest first, and the database clock.

    The clock (``None`` with no rows) is read by the same statement, just
    before the rows are sent: what they are marked ``queued`` at.

    ``locked`` (inside a transaction) locks the rows returned and passes over
    rows another transaction holds, so concurrent publishers take different
    batches (``FOR UPDATE SKIP LOCKED`` of the execution rows only; the
    schedule is outer-joined for its message fields). SQLite has no row locks and
    Django ignores the clause there: a writer holds the whole database, so
    publishers are serialised at their ``mark_queued``, and two that read
    the same rows first both send them (the worker claims each once); the
    beat publishes from its leader alone there. A row committed ahead of its
    instant is returned there only once no give-back can delete it
    (``_not_given_back``).
    """
    rows = Execution.objects.filter(status=Status.PENDING, buffered=False).exclude(_ahead_of_its_instant())
    if locked:
        rows = rows.select_for_update(skip_locked=True, of=("self",))
    values = list(
        rows.order_by("created_at", "id")
        .annotate(read_at=RawSQL(dbclock.now_sql(), [], output_field=DateTimeField()))
        .values(*MESSAGE_FIELDS, "schedule_id", "created_at", "read_at", **SCHEDULE_MESSAGE_FIELDS)[:limit]
    )
    if not values:
        return [], None
    read_at = dbclock.as_datetime(values[0]["read_at"])
    committed_ahead: set[int] = set()
    if locked and not connections[rows.db].features.has_select_for_update:
        committed_ahead = {row["id"] for row in values if row["scheduled_for"] > row["created_at"]}
    for row in values:
        del row["read_at"], row["created_at"]
    if committed_ahead:
        given_back = committed_ahead - _not_given_back(committed_ahead)
        values = [row for row in values if row["id"] not in given_back]
    return values, read_at


def _not_given_back(ids: Collection[int]) -> set[int]:
    """Those of ``ids``, rows committed ahead and read as due, still ``pending`` once no give-back can delete them.

    For a database without row locks (SQLite): a give-back deletes only rows
    it reads as ahead of their instant, inside a transaction that holds the
    write lock (``withdraw_ahead``), and it may have read these before their
    instant, in a transaction still open. Taking the write lock here waits
    for such a transaction to end; any later one reads them as due and
    leaves them. So a message is never sent for a row given back.
    """
    with transaction.atomic():  # BEGIN IMMEDIATE: the write lock
        return set(
            Execution.objects.filter(AnyOf(F("pk"), list(ids)), status=Status.PENDING).values_list("pk", flat=True)
        )


def mark_queued(ids: Iterable[int], *, now: datetime) -> int:
    """Record the ``pending`` executions ``ids`` as sent at ``now``; return how many changed."""
    pending = Execution.objects.filter(AnyOf(F("pk"), list(ids)), status=Status.PENDING)
    return _move(pending, Status.QUEUED, enqueued_at=now)


def mark_resent(execution_id: int, *, was_enqueued_at: datetime | None, now: datetime) -> bool:
    """Take a waiting execution for a re-send at ``now``, unless someone else took it since ``was_enqueued_at``."""
    return bool(
        Execution.objects.filter(
            pk=execution_id, status__in=Execution.WAITING_STATUSES, enqueued_at=was_enqueued_at
        ).update(enqueued_at=now)
    )


def release_buffered() -> int:
    """Let ``buffer_one`` rows go once their schedule has nothing else in flight; return how many."""
    others_in_flight = Execution.objects.filter(
        schedule_id=OuterRef("schedule_id"), status__in=Execution.IN_FLIGHT_STATUSES, buffered=False
    )
    return (
        Execution.objects.filter(buffered=True, status=Status.PENDING)
        .exclude(Exists(others_in_flight))
        .update(buffered=False)
    )


# --- claims -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A worker's hold on a running execution; ``attempt`` is its fencing token."""

    execution_id: int
    attempt: int
    #: The schedule whose counters the outcome moves (``None``: an ad-hoc execution).
    schedule_id: int | None = None
    started_at: datetime | None = None
    max_retries: int = 0
    #: Earlier attempts that ended in the task's own error and were retried (``error_retries``).
    error_retries: int = 0

    @classmethod
    def of(cls, execution: Execution) -> Claim:
        """Return the claim ``execution`` (a running row as read) stands for."""
        return cls(
            execution.pk,
            execution.attempt,
            execution.schedule_id,
            execution.started_at,
            execution.max_retries,
            error_retries(execution.attempt_errors),
        )

    def rows(self) -> QuerySet[Execution]:
        """Return the row while this claim still holds it (else nothing)."""
        return Execution.objects.filter(pk=self.execution_id, attempt=self.attempt, status=Status.RUNNING)


def retries_left(held: Claim) -> bool:
    """Return whether another attempt may follow the one ``held`` runs, which raised an error.

    Only the task's own errors count against ``max_retries``: attempts lost
    with their worker before this one do not (``lost_retries_left``).
    """
    return held.error_retries < held.max_retries


def lost_error(attempt: int) -> str:
    """Return the ``attempt_errors`` error of ``attempt``, lost with its worker and run again."""
    return f"Worker lost during attempt {attempt}"


def connection_lost_error(attempt: int) -> str:
    """Return the ``attempt_errors`` error of ``attempt``, whose body the database server cut off, run again."""
    return f"Database connection lost during attempt {attempt}"


def _is_loss(entry: dict[str, Any]) -> bool:
    attempt = entry.get("attempt", 0)
    return entry.get("error") in (lost_error(attempt), connection_lost_error(attempt))


def error_retries(attempt_errors: list[dict[str, Any]] | None) -> int:
    """Return how many of the attempts in ``attempt_errors`` raised an error and were retried (not lost ones)."""
    return sum(1 for entry in attempt_errors or () if not _is_loss(entry))


def lost_attempts(attempt: int, attempt_errors: list[dict[str, Any]] | None) -> int:
    """Return how many of attempts 1 to ``attempt`` were lost with their worker, ``attempt`` being one.

    Each attempt before the current one was either retried after the task's
    own error (an ``attempt_errors`` entry with that error) or lost with its
    worker (an entry from ``retry_lost``, or none when another worker took
    the claim over once it expired): whatever is not an error is a loss.
    """
    return attempt - error_retries(attempt_errors)


def lost_retries_left(lost: int, max_retries: int) -> bool:
    """Return whether an execution that has lost ``lost`` attempts with their worker may run again.

    A lost worker is not the task failing: lost attempts are counted apart
    from the task's errors, and up to ``max_retries + LOST_RETRIES`` of them
    are run again, so a worker killed or frozen mid-task costs a re-run, not
    one of the task's retries, while a task that kills every worker it runs
    on still ends.
    """
    return lost <= max_retries + settings.LOST_RETRIES


def loss_retries_left(held: Claim) -> bool:
    """Return whether the attempt ``held`` runs, lost (its database connection cut), may be run again."""
    return lost_retries_left(held.attempt - held.error_retries, held.max_retries)


@tracing.traced("scheduler.claim", tracing.claiming_attributes, tracing.claimed_attributes)
def claim(
    *,
    worker: str,
    task: str,
    celery_task_id: str,
    execution_id: int | None = None,
    key: str = "",
    place: work_rules.Place | None = None,
) -> Execution | None:
    """Claim the execution ``execution_id`` (or the one with ``key``) for ``worker``; return it as claimed.

    ``task`` and ``celery_task_id`` are the message's task name and task id:
    only the message sent for the execution claims it, so both must equal
    the row's (every row that is sent has its task id from the moment it is
    recorded; a re-send and Celery's own retry keep it). One conditional
    UPDATE under ``claimable()`` that returns the row as it wrote it (one
    round trip; PostgreSQL and SQLite 3.35+ both have ``UPDATE ...
    RETURNING``, so nothing can change the row between the write and the
    read). A running row claimed again belongs to a worker that stopped
    renewing, so it gets the next attempt.

    Under a concurrency limit (``place``), the execution takes its key first,
    and the claim's UPDATE also requires fewer than ``place.limit`` others of
    the key running or waiting ahead of it (``_under_limit``); on PostgreSQL
    the claims of one key queue on an advisory lock taken in the claim's
    transaction, so each one counts the claims committed before it (SQLite
    has one writer at a time). ``None`` then may mean it waits for a place
    (``wait_for_place``).

    ``None`` means nothing was claimable (a duplicate delivery). A message
    that was not sent for the execution raises ``MessageRefused``, counted
    by reason, and changes nothing: told apart from a duplicate by one read
    on this path only.
    """
    _refuse_unrecordable(task, celery_task_id, execution_id)
    using = Execution.objects.db
    by_id = execution_id is not None
    target = execution_id if by_id else key
    values = {"target": target, "worker": worker, "task": task, "celery_task_id": celery_task_id}
    failpoint("worker.claim.before")
    if place is None:
        row = _CLAIM.execute(using, (by_id, settings.CLAIM_SECONDS, False), values)
    else:
        _named(execution_id, key).filter(status__in=Execution.WAITING_STATUSES).exclude(
            concurrency_key=place.key
        ).update(concurrency_key=place.key)
        with transaction.atomic(using=using):
            if connections[using].vendor == "postgresql":
                with connections[using].cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [_KEY_LOCK_CLASS, place.key])
            values.update(concurrency_key=place.key, limit=place.limit)
            row = _CLAIM.execute(using, (by_id, settings.CLAIM_SECONDS, True), values)
    if row is None:
        found = _named(execution_id, key).values_list("pk", "task", "celery_task_id").first()
        _refuse_unless_sent_for(found, task, celery_task_id)
        return None
    return _claimed(using, row)


def _claimed(using: str, row: tuple[Any, ...]) -> Execution:
    """The execution a claim's ``RETURNING`` row names, its time limit held to from now on."""
    execution = _ROW.read(using, row)
    failpoint("worker.claim.after")
    if execution.timeout:
        _hold_to_time_limit(Claim.of(execution), execution.timeout)
    return execution


def _named(execution_id: int | None, key: str) -> ExecutionQuerySet:
    """The execution a message names: by id, else by its ad-hoc key."""
    if execution_id is not None:
        return Execution.objects.filter(pk=execution_id)
    return Execution.objects.filter(idempotency_key=key)


def _claim_sql(using: str, by_id: bool, claim_seconds: float, limited: bool) -> tuple[str, list[Any]]:
    """The claim's UPDATE ... RETURNING, compiled once per database (``Prepared``)."""
    # The message's own task name and task id are matched, never written.
    sent_for = Execution.objects.filter(
        task=Param("task", _field("task")), celery_task_id=Param("celery_task_id", _field("celery_task_id"))
    )
    if by_id:
        target = sent_for.filter(pk=Param("target", Execution._meta.pk))
    else:
        target = sent_for.filter(idempotency_key=Param("target", _field("idempotency_key")))
    if limited:
        target = target.filter(_under_limit())
    sql, params = _update_sql(
        _moving(target.claimable(), Status.RUNNING),
        using,
        status=Status.RUNNING,
        worker=Param("worker", _field("worker")),
        started_at=Now(),
        finished_at=None,
        claim_expires_at=_db_now_plus(claim_seconds),
        attempt=Case(
            When(status=Status.RUNNING, then=_NEXT_ATTEMPT), default=F("attempt"), output_field=PositiveIntegerField()
        ),
        **({"concurrency_key": Param("concurrency_key", _field("concurrency_key"))} if limited else {}),
    )
    return f"{sql} RETURNING {_ROW.columns(using)}", params


def _under_limit() -> LessThan:
    """Fewer than the limit of the key's others run, or wait ahead of this one (oldest first)."""
    the_key = Execution.objects.filter(concurrency_key=Param("concurrency_key", _field("concurrency_key")))
    others = the_key.filter(
        (Q(status=Status.RUNNING) & ~Q(pk=OuterRef("pk"))) | Q(status__in=_AHEAD, pk__lt=OuterRef("pk"))
    )
    counted = Subquery(others.order_by().annotate(n=Func(F("pk"), function="COUNT")).values("n"))
    return LessThan(counted, Param("limit", PositiveIntegerField()))


#: Waiting rows of a key that a newer one may not pass (a due retry does not hold the line).
_AHEAD = (Status.PENDING, Status.QUEUED)
#: The first key of the advisory locks a key's claims queue on (PostgreSQL); the second is the key's hash.
_KEY_LOCK_CLASS = 0x5C0C

#: The statements a worker runs for every task, compiled once per process (``scheduler.fastpath.prepared``).
_CLAIM = Prepared(_claim_sql)
_ROW = RowReader(Execution)

# --- waiting for a concurrency limit's place --------------------------------------------

#: An execution offered a slot this recently has its message on the way: it is not offered again yet.
OFFER_GRACE_SECONDS = 5.0


def wait_for_place(*, execution_id: int | None = None, key: str = "") -> tuple[str, int] | None:
    """Leave the execution a limited claim did not take waiting for a place; return its key and place in line.

    ``None``: it does not wait (it ran, ended, or has no key: the claim found
    it was not claimable). Its message is acknowledged and nothing is sent
    for it until a place frees (``offer_waiting``): ``enqueued_at`` is
    cleared to say so.
    """
    named = _named(execution_id, key).claimable()  # not claimable (a retry not due yet): not the limit's doing
    # pending too: its message can come before its sender marks it queued
    rows = named.filter(status__in=(Status.PENDING, Status.QUEUED, Status.RETRYING), concurrency_key__isnull=False)
    found = rows.values_list("pk", "concurrency_key").first()
    if found is None:
        return None
    pk, concurrency_key = found
    rows.update(enqueued_at=None)
    ahead = Execution.objects.filter(concurrency_key=concurrency_key, status__in=_AHEAD, pk__lt=pk).count()
    return concurrency_key, ahead + 1


def offer_waiting(concurrency_key: str, limit: int | None, *, now: datetime) -> list[dict[str, Any]]:
    """Take the oldest executions waiting for a place of ``concurrency_key`` that are free now; return their messages.

    As many as the key has places free, less those offered within
    ``OFFER_GRACE_SECONDS`` (their messages are on the way). ``limit``
    ``None``: the limit is gone, and every waiting execution of the key is
    let go. Each is taken by one conditional UPDATE (``mark_resent``), so
    two processes offering at once do not both take it.
    """
    keyed = Execution.objects.filter(concurrency_key=concurrency_key)
    waiting = keyed.filter(status__in=(Status.QUEUED, Status.RETRYING)).order_by("pk")
    if limit is None:
        ids = list(waiting.values_list("pk", flat=True)[:_BATCH])
        Execution.objects.filter(pk__in=ids).update(concurrency_key=None, enqueued_at=now)
        return message_rows(Execution.objects.filter(pk__in=ids))
    cutoff = now - timedelta(seconds=OFFER_GRACE_SECONDS)
    on_the_way = waiting.filter(enqueued_at__gte=cutoff, enqueued_at__lte=now)
    free = limit - keyed.filter(status=Status.RUNNING).count() - on_the_way.count()
    if free <= 0:
        return []
    due = waiting.filter(Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=cutoff)).exclude(
        status=Status.RETRYING, enqueued_at__gt=now
    )
    taken = [
        pk
        for pk, enqueued_at in due.values_list("pk", "enqueued_at")[:free]
        if mark_resent(pk, was_enqueued_at=enqueued_at, now=now)
    ]
    return message_rows(Execution.objects.filter(pk__in=taken)) if taken else []


def send_later(execution_id: int, *, due: datetime) -> list[dict[str, Any]]:
    """Take a waiting execution for a message that runs at ``due``; return it as a message row (none: not waiting).

    Its ``enqueued_at`` becomes ``due``: reconcile does not count it unclaimed before then.
    """
    rows = Execution.objects.filter(pk=execution_id, status__in=(Status.QUEUED, Status.RETRYING))
    if not rows.update(enqueued_at=due):
        return []
    return [{**row, "not_before": due} for row in message_rows(rows)]


def waiting_keys(*, limit: int = _BATCH) -> list[str]:
    """The keys some execution waits for a place of (at most ``limit``)."""
    waiting = Execution.objects.filter(status__in=(Status.QUEUED, Status.RETRYING), concurrency_key__isnull=False)
    return list(waiting.order_by().values_list("concurrency_key", flat=True).distinct()[:limit])


def place_usage(prefix: str, *, of_tenant: str | None = None) -> list[tuple[str, int, int]]:
    """(key, running, waiting) of each key starting with ``prefix`` that runs or waits, busiest first.

    ``of_tenant``: only the keys that tenant's own work runs or waits under
    (with everyone's counts there: a limit of every tenant is shared).
    """
    in_flight = Execution.objects.filter(
        concurrency_key__startswith=prefix, status__in=(Status.RUNNING, Status.QUEUED, Status.RETRYING)
    ).filter(concurrency_key__isnull=False)
    if of_tenant is not None:
        in_flight = in_flight.filter(concurrency_key__in=in_flight.filter(tenant=of_tenant).values("concurrency_key"))
    rows = (
        in_flight.order_by()
        .values("concurrency_key")
        .annotate(
            running=Count("pk", filter=Q(status=Status.RUNNING)),
            waiting=Count("pk", filter=~Q(status=Status.RUNNING)),
        )
    )
    usage = [(row["concurrency_key"], row["running"], row["waiting"]) for row in rows]
    return sorted(usage, key=lambda entry: (-entry[1], -entry[2], entry[0]))


def limit_usage() -> dict[int, tuple[int, int]]:
    """{limit id: (running, waiting)} over all its keys, for the limits anything runs or waits under."""
    usage: dict[int, tuple[int, int]] = {}
    for key, running, waiting in place_usage(""):
        pk = work_rules.limit_id(key)
        before = usage.get(pk, (0, 0))
        usage[pk] = (before[0] + running, before[1] + waiting)
    return usage


def place_in_line(execution: Execution) -> int | None:
    """Where ``execution`` waits for a slot of its key (1: next); ``None`` when it does not wait."""
    if not execution.concurrency_key or execution.status not in (Status.QUEUED, Status.RETRYING):
        return None
    ahead = Execution.objects.filter(concurrency_key=execution.concurrency_key, status__in=_AHEAD, pk__lt=execution.pk)
    return ahead.count() + 1


#: Why a message was refused: it names the execution under another task name, or another task id;
#: its task id is one no row can hold; its execution id header is no row's id.
TASK_MISMATCH = "task_mismatch"
TASK_ID_MISMATCH = "task_id_mismatch"
TASK_ID_UNRECORDABLE = "task_id_unrecordable"
EXECUTION_ID_INVALID = "execution_id_invalid"
REFUSAL_REASONS = (TASK_MISMATCH, TASK_ID_MISMATCH, TASK_ID_UNRECORDABLE, EXECUTION_ID_INVALID)
#: The longest Celery task id a row records: its ad-hoc key (``celery:`` and the id) fits in 255 characters.
MAX_TASK_ID_LENGTH = 255 - len(ad_hoc_key(""))


def valid_execution_id(header: Any) -> int | None:
    """The execution id a message's header names, or ``None`` when it is none: the senders write a row's id."""
    if limits.is_whole_number(header) and 0 < header <= limits.KEY_MAX:
        return header
    return None


def execution_id_of(header: Any, *, task: str, celery_task_id: Any) -> int:
    """The execution id a message's header names; ``MessageRefused`` (counted) when it is no row's id.

    A whole number in a key's range is what every sender writes; text, a
    fraction, ``True`` or a list comes from none, and would reach the
    statements as something else (``1.5`` as execution 1).
    """
    execution_id = valid_execution_id(header)
    if execution_id is not None:
        return execution_id
    _count_refused(EXECUTION_ID_INVALID)
    raise MessageRefused(
        f"message {str(celery_task_id)[:64]!r} (task {task}) refused: its {Execution.MESSAGE_HEADER} header "
        f"{str(header)[:64]!r} is no execution's id: {EXECUTION_ID_INVALID}",
        reason=EXECUTION_ID_INVALID,
        message_task=task,
        message_task_id=str(celery_task_id),
    )


def _refuse_unrecordable(task: str, celery_task_id: Any, execution_id: int | None = None) -> None:
    """Raise ``MessageRefused`` (counted) for a task id no row can hold: not text, with a NUL character, or too long.

    PostgreSQL refuses a NUL and a key past 255 characters (SQLite would
    store them): refused before any statement, the message is refused
    alike on both, without a traceback.
    """
    if isinstance(celery_task_id, str) and "\x00" not in celery_task_id and len(celery_task_id) <= MAX_TASK_ID_LENGTH:
        return
    _count_refused(TASK_ID_UNRECORDABLE)
    raise MessageRefused(
        f"message {str(celery_task_id)[:64]!r} (task {task}) refused: a task id is text without a NUL character, "
        f"at most {MAX_TASK_ID_LENGTH} characters long: {TASK_ID_UNRECORDABLE}",
        reason=TASK_ID_UNRECORDABLE,
        execution_id=execution_id,
        message_task=task,
        message_task_id=str(celery_task_id),
    )


def _refuse_unless_sent_for(found: tuple[int, str, str] | None, task: str, celery_task_id: str) -> None:
    """Raise ``MessageRefused`` (counted) unless a message of ``task`` and ``celery_task_id`` was sent for ``found``.

    ``found`` is an execution's (id, task, Celery task id), or ``None``
    when there is no such execution. A row's task and task id never change
    once recorded, so after a conditional write changed nothing, this read
    of them tells a refusal from a duplicate.
    """
    if found is None:
        return
    execution_id, row_task, row_task_id = found
    if row_task != task:
        reason = TASK_MISMATCH
    elif row_task_id != celery_task_id:
        reason = TASK_ID_MISMATCH
    else:
        return
    _count_refused(reason)
    raise MessageRefused(
        f"message {celery_task_id} (task {task}) refused for execution {execution_id} "
        f"(task {row_task}, celery id {row_task_id}): {reason}",
        reason=reason,
        execution_id=execution_id,
        task=row_task,
        celery_task_id=row_task_id,
        message_task=task,
        message_task_id=celery_task_id,
    )


def _count_refused(reason: str) -> None:
    """Count one refused message (``/metrics``: ``scheduler_messages_refused_total``): an increment, as the trigger's."""
    TallyIncrement.objects.create(status=MESSAGE_REFUSED, task="", trigger=reason)


def _hold_to_time_limit(held: Claim, timeout: int) -> None:
    """Make ``held`` last until its hard time limit (``timeout`` + grace from now) when that is later.

    The worker's hard limit kills a body ``timeout + TIMEOUT_GRACE_SECONDS``
    after its claim, so until then nobody may take the execution over,
    whether or not its worker still renews: a frozen worker's body may run
    until that limit, which then stops it. (A second, fenced UPDATE: the
    claim made just before cannot run out in between.)
    """
    seconds = timeout + settings.TIMEOUT_GRACE_SECONDS
    if seconds > settings.CLAIM_SECONDS:
        held.rows().update(claim_expires_at=_db_now_plus(seconds))


def held_by(*, worker: str, execution_id: int | None = None, key: str = "") -> Claim | None:
    """Return the claim ``worker`` (``process_ids.process_id``) holds on that execution, if it still holds one.

    For a worker's main process acting on behalf of a pool child: the child
    wrote its identity with the claim, so this finds the claim that child
    made and never a successor's (another process, another identity).
    """
    rows = (
        Execution.objects.filter(pk=execution_id)
        if execution_id is not None
        else Execution.objects.filter(idempotency_key=key)
    )
    execution = rows.filter(worker=worker, status=Status.RUNNING).first()
    return Claim.of(execution) if execution is not None else None


#: The longest a renewal waits for a lock other than a claim's row (which it never waits for).
RENEW_LOCK_WAIT_SECONDS = 1.0


def renew(claims: Iterable[Claim], *, seconds: float, bodies: Mapping[Claim, int] | None = None) -> set[Claim]:
    """Extend each claim that still holds by ``seconds`` (database clock); return the claims that hold.

    One short transaction that never waits for a claim's row: a row another
    transaction holds locked is passed over (PostgreSQL ``SKIP LOCKED``;
    any other lock wait ends after ``RENEW_LOCK_WAIT_SECONDS``). Such a claim
    is returned all the same when the transaction holding its row is its own
    body's (``bodies``: claim -> backend pid of the session its body runs
    on; PostgreSQL): a body's ``checkpoint()`` inside its own ``atomic()``
    keeps the row locked to the end of that transaction, and while it does
    nobody can take the execution over, cancel it or mark it lost. On SQLite
    the transaction waits for the database's write lock up to the busy
    timeout. A wait that runs out raises (``session_limits.lock_wait_ended``
    tells it apart): the database is busy, not the claim gone.

    A claim never gets shorter: one that lasts to its hard time limit (``_hold_to_time_limit``) keeps that.
    """
    claims = list(claims)
    with transaction.atomic():
        session_limits.bound_lock_wait(RENEW_LOCK_WAIT_SECONDS)
        free = set(
            _matching(claims)
            .filter(status=Status.RUNNING)
            .select_for_update(skip_locked=True, no_key=True)
            .values_list("pk", "attempt")
        )
        if free:
            Execution.objects.filter(pk__in=[pk for pk, _ in free]).update(claim_expires_at=_extended(seconds))
    held = {claim for claim in claims if (claim.execution_id, claim.attempt) in free}
    locked = {claim: pid for claim, pid in (bodies or {}).items() if claim in claims and claim not in held}
    if locked and transaction.get_connection().vendor == "postgresql":
        held |= _held_by_their_bodies(locked)
    return held


def _held_by_their_bodies(bodies: Mapping[Claim, int]) -> set[Claim]:
    """PostgreSQL: those claims, still running, whose row the open transaction of their body's session holds locked.

    The row as committed names the locking transaction in ``xmax``; its
    transaction id lock (``pg_locks``) names the session holding it.
    """
    values = ", ".join(["(%s::bigint, %s::integer, %s::integer)"] * len(bodies))
    params = [value for claim, pid in bodies.items() for value in (claim.execution_id, claim.attempt, pid)]
    with transaction.get_connection().cursor() as cursor:
        cursor.execute(
            f"SELECT e.id, e.attempt FROM {Execution._meta.db_table} e "
            f"JOIN (VALUES {values}) AS body(id, attempt, pid) ON e.id = body.id AND e.attempt = body.attempt "
            "JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = e.xmax "
            "AND l.pid = body.pid AND l.granted "
            "WHERE e.status = %s",
            [*params, Status.RUNNING],
        )
        found = set(cursor.fetchall())
    return {claim for claim in bodies if (claim.execution_id, claim.attempt) in found}


def _extended(seconds: float) -> Case:
    """``claim_expires_at`` moved to the database clock plus ``seconds``, unless it is later already."""
    renewed = _db_now_plus(seconds)
    return Case(
        When(claim_expires_at__gt=renewed, then=F("claim_expires_at")), default=renewed, output_field=DateTimeField()
    )


#: Where a claim's own holder may leave its row: the holder's outcome is not a lost claim.
_HOLDER_ENDS = (Status.RUNNING, Status.SUCCEEDED, Status.TIMED_OUT)


def moved_on(claims: Iterable[Claim]) -> set[Claim]:
    """Return those of ``claims`` whose execution moved on without them (for a renewal that renewed fewer).

    Moved on: another attempt holds it, or it was cancelled, marked lost, or
    failed by someone else. A row its own holder just finished (``succeeded``
    by a fenced block, ``timed_out``) has not.
    """
    claims = list(claims)
    kept = set(_matching(claims).filter(status__in=_HOLDER_ENDS).values_list("pk", "attempt"))
    return {held for held in claims if (held.execution_id, held.attempt) not in kept}


def still_running(claims: Iterable[Claim]) -> set[Claim]:
    """Return those of ``claims`` whose row, as committed, is still ``running`` under them (not ended by their holder)."""
    claims = list(claims)
    running = set(_matching(claims).filter(status=Status.RUNNING).values_list("pk", "attempt"))
    return {held for held in claims if (held.execution_id, held.attempt) in running}


def _matching(claims: Iterable[Claim]) -> QuerySet[Execution]:
    match = Q(pk__in=[])
    for held in claims:
        match |= Q(pk=held.execution_id, attempt=held.attempt)
    return Execution.objects.filter(match)


def release(held: Claim) -> bool:
    """Expire ``held`` at once (its process is gone), so the execution may be claimed again now."""
    return bool(held.rows().update(claim_expires_at=_db_now_plus(-1)))


@tracing.traced("scheduler.finish", tracing.claim_attributes)
def finish(
    held: Claim,
    *,
    status: str,
    result: Any = None,
    error: str = "",
    traceback_text: str = "",
    celery_row: dict[str, Any] | None = None,
) -> bool:
    """Record the outcome of ``held`` and count it on its schedule; with ``celery_row``, store Celery's result too.

    ``celery_row`` is the TaskResult row of a success (``fastpath.celery_result.row_of``): written by the
    outcome's own statement, and only with it. Returns False, having written nothing, when the claim moved on.
    """
    finished = _record_outcome(
        lambda: _finish_held(held, status, result, error, traceback_text, celery_row),
        held.schedule_id,
        held.started_at,
        status=status,
        error=error,
        execution_id=held.execution_id,
    )
    if not finished:
        logger.warning(
            "execution %s attempt %s: the claim moved on; its outcome here (%s) is not recorded",
            held.execution_id,
            held.attempt,
            status,
            extra={"action": "claim_lost", "execution_id": held.execution_id},
        )
    return finished


@tracing.traced("scheduler.finish", tracing.claim_attributes)
def finish_in_transaction(held: Claim) -> bool:
    """Record ``held`` ``succeeded`` inside the caller's open transaction, if the claim still holds.

    The conditional UPDATE is the re-check and the lock at once: it matches
    (id, attempt, ``running``) and keeps the row locked until the caller
    commits, so no successor can claim the execution in between (SQLite: the
    IMMEDIATE transaction already holds the write lock). A successor that
    committed first leaves nothing to match: False, and the caller rolls
    back. The schedule row is locked first, as ``_record_outcome`` does.
    """
    if not transaction.get_connection().in_atomic_block:
        raise TransactionManagementError("finish_in_transaction() needs the caller's transaction.atomic()")
    return _record_outcome(
        lambda: _finish_held(held, Status.SUCCEEDED, None, "", ""),
        held.schedule_id,
        held.started_at,
        status=Status.SUCCEEDED,
    )


def record_result(held: Claim, result: Any) -> bool:
    """Store ``result`` on the execution ``held``'s fenced block recorded ``succeeded``; False if it is not that."""
    values = {"id": held.execution_id, "attempt": held.attempt, "result": result}
    return bool(_RESULT.execute(Execution.objects.db, (), values))


def save_checkpoint(held: Claim, data: Any) -> bool:
    """Save ``data`` as the progress of the execution ``held`` runs; False (nothing written) if the claim moved on.

    It renews the claim too, in the same UPDATE: inside the body's own
    transaction, whose lock on the row the renewer then leaves alone
    (``renew``), the renewal commits with it.
    """
    return bool(held.rows().update(progress=data, claim_expires_at=_extended(settings.CLAIM_SECONDS)))


def fail_exhausted(held: Claim) -> str | None:
    """Fail ``held`` if it took over from a lost attempt that had no retries left; return the reason.

    ``None`` means the attempt may run. The attempts before it that did not
    end in an error were lost (``lost_attempts``).
    """
    if lost_retries_left(held.attempt - 1 - held.error_retries, held.max_retries):
        return None
    reason = f"{lost_error(held.attempt - 1)}; no retries left"
    if finish(held, status=Status.FAILED, error=reason):
        logger.error(
            "execution %s failed: %s",
            held.execution_id,
            reason,
            extra={"action": "execution_failed", "execution_id": held.execution_id},
        )
    return reason


@tracing.traced("scheduler.retry", tracing.claim_attributes)
def retry(held: Claim, *, delay_seconds: float, error: str = "", traceback_text: str = "") -> bool:
    """Move ``held`` to ``retrying`` as the next attempt, due in ``delay_seconds``; False if the claim moved on.

    ``enqueued_at`` is when the retry is due (database clock): no message
    claims it before then (``claimable``), and reconcile sends it again if
    nobody claims it after. The failed attempt's ``error`` is appended to
    ``attempt_errors``: read, then written by the same fenced UPDATE, so it
    lands only while this claim holds the row, and nobody else appends then.
    """
    read = held.rows().annotate(db_now=Now()).values_list("attempt_errors", "db_now").first()
    if read is None:
        return False
    earlier, now = read
    return bool(
        _move(
            held.rows(),
            Status.RETRYING,
            attempt=_NEXT_ATTEMPT,
            claim_expires_at=None,
            enqueued_at=_db_now_plus(delay_seconds),
            error=error,
            traceback=traceback_text,
            attempt_errors=[*(earlier or []), attempt_error(held.attempt, error, at=now)],
        )
    )


def retry_due_in(*, execution_id: int | None = None, key: str = "") -> float | None:
    """Return the seconds (database clock) until that ``retrying`` execution's retry is due; ``None`` if it is due or not retrying."""
    rows = (
        Execution.objects.filter(pk=execution_id)
        if execution_id is not None
        else Execution.objects.filter(idempotency_key=key)
    )
    read = rows.retry_not_due().annotate(db_now=_db_now_plus(0)).values_list("enqueued_at", "db_now").first()
    return (read[0] - read[1]).total_seconds() if read is not None else None


def attempt_error(attempt: int, error: str, *, at: datetime) -> dict[str, Any]:
    """Return one ``Execution.attempt_errors`` entry: ``{"attempt": n, "error": "...", "at": ISO}``."""
    return {"attempt": attempt, "error": error, "at": at.astimezone(timezone.utc).isoformat()}


def undo_retry(held: Claim) -> bool:
    """Give ``held`` back to its holder after ``retry`` when the retry could not be sent.

    Applies only while nobody claimed the retry meanwhile. The entry
    ``retry`` appended to ``attempt_errors`` goes too: the attempt was not
    retried, and the entries count the retries used (``error_retries``).
    """
    waiting = Execution.objects.filter(pk=held.execution_id, attempt=held.attempt + 1, status=Status.RETRYING)
    read = waiting.values_list("attempt_errors", flat=True).first()
    if read is None:
        return False
    entries = list(read or [])
    if entries and entries[-1].get("attempt") == held.attempt:
        entries.pop()
    expires = _db_now_plus(settings.CLAIM_SECONDS)
    return bool(_move(waiting, Status.RUNNING, attempt=held.attempt, claim_expires_at=expires, attempt_errors=entries))


# --- recovery, refusal and cancellation ---------------------------------------------------------


def mark_lost(ids: Iterable[int]) -> int:
    """Record those of the executions ``ids`` whose claim expired (database clock) ``lost``; return how many.

    A row another transaction holds locked is passed over, not waited for
    (PostgreSQL ``SKIP LOCKED``): its holder is writing it (a worker frozen
    inside a transaction holds it until the server ends its session); the
    next pass looks at it again.
    """
    expired = Execution.objects.filter(id__in=list(ids), status=Status.RUNNING, claim_expires_at__lt=Now())
    with transaction.atomic():
        free = list(expired.select_for_update(skip_locked=True, no_key=True).values_list("pk", flat=True))
        return _move(expired.filter(pk__in=free), Status.LOST, claim_expires_at=None)


def retry_lost(execution_id: int, *, due: datetime) -> bool:
    """Move a ``lost`` execution to ``retrying`` as its next attempt, due at ``due`` (its ``enqueued_at``).

    The lost attempt is appended to ``attempt_errors``; the write matches
    the attempt read, so a concurrent retry of the same row changes nothing.
    """
    lost = Execution.objects.filter(pk=execution_id, status=Status.LOST)
    read = lost.annotate(db_now=Now()).values_list("attempt", "attempt_errors", "db_now").first()
    if read is None:
        return False
    attempt, earlier, now = read
    entry = attempt_error(attempt, lost_error(attempt), at=now)
    return bool(
        _move(
            lost.filter(attempt=attempt),
            Status.RETRYING,
            attempt=_NEXT_ATTEMPT,
            enqueued_at=due,
            attempt_errors=[*(earlier or []), entry],
        )
    )


def fail_lost(execution: Execution, *, reason: str) -> bool:
    """Record a ``lost`` execution ``failed`` with ``reason`` and count it on its schedule."""
    lost = Execution.objects.filter(pk=execution.pk, status=Status.LOST)
    return _record_outcome(
        lambda: _finish_rows(lost, Status.FAILED, None, reason, ""),
        execution.schedule_id,
        execution.started_at,
        status=Status.FAILED,
        error=reason,
        execution_id=execution.pk,
    )


def fail_unrun(execution_id: int, *, task: str, celery_task_id: str, reason: str) -> bool:
    """Record a waiting execution ``failed`` with ``reason`` without running it; count it on its schedule.

    For a worker that rejected the message ``task``/``celery_task_id``
    sent for it: a message that names the execution under another task
    name or task id raises ``MessageRefused`` (counted), as a claim would,
    and changes nothing. Only a ``pending``, ``queued`` or ``retrying`` row
    changes: one that runs or has finished keeps its status. Returns
    whether the row changed.
    """
    _refuse_unrecordable(task, celery_task_id, execution_id)
    read = ("pk", "schedule_id", "started_at", "task", "celery_task_id")
    execution = Execution.objects.filter(pk=execution_id).only(*read).first()
    if execution is None:
        return False
    _refuse_unless_sent_for((execution.pk, execution.task, execution.celery_task_id), task, celery_task_id)
    waiting = Execution.objects.filter(
        pk=execution_id, status__in=Execution.WAITING_STATUSES, task=task, celery_task_id=celery_task_id
    )
    return _record_outcome(
        lambda: _finish_rows(waiting, Status.FAILED, None, reason, ""),
        execution.schedule_id,
        execution.started_at,
        status=Status.FAILED,
        error=reason,
        execution_id=execution_id,
    )


def cancel_expired(execution_id: int, *, task: str, celery_task_id: str, reason: str) -> bool:
    """Record a waiting execution ``cancelled`` with ``reason``: its message expired before a worker started it.

    Only the message sent for it (its task name and task id) cancels it, and
    only while it waits. Not a run: its schedule's counters stay as they
    were. Returns whether the row changed.
    """
    _refuse_unrecordable(task, celery_task_id, execution_id)
    waiting = Execution.objects.filter(
        pk=execution_id, status__in=Execution.WAITING_STATUSES, task=task, celery_task_id=celery_task_id
    )
    return bool(_move(waiting, Status.CANCELLED, finished_at=Now(), claim_expires_at=None, error=reason))


def cancel(execution_id: int, *, reason: str, now: datetime) -> bool:
    """Record the execution ``cancelled`` at ``now`` if it has not finished; return whether it changed.

    A worker running it loses its claim: its outcome is not recorded.
    """
    return bool(_cancel(Execution.objects.filter(pk=execution_id), reason=reason, now=now))


def committed_ahead_by(dispatcher: str) -> list[int]:
    """The schedules with a slot the beat replica ``dispatcher`` committed ahead of its instant."""
    ahead = Execution.objects.filter(dispatcher=dispatcher, status=Status.PENDING).filter(_ahead_of_its_instant())
    return sorted(set(ahead.values_list("schedule_id", flat=True)))


def withdraw_ahead(schedule_ids: Collection[int]) -> dict[int, tuple[datetime, int]]:
    """Delete the slots of ``schedule_ids`` the leader committed ahead of their instant; return {schedule id: (earliest, count)}.

    Such a row was never sent (``pending_rows`` passes it over until its
    instant), so deleting it undoes its commit; the caller gives the slot
    back to its schedule (``schedules.give_back_ahead``), holding the
    schedule's row locked first. A publisher that took the row at its
    instant holds it locked: this waits, and then finds it sent (on SQLite
    the publisher waits for this transaction instead: ``_not_given_back``).
    """
    ahead = (
        Execution.objects.filter(schedule_id__in=list(schedule_ids), status=Status.PENDING)
        .filter(_ahead_of_its_instant())
        .select_for_update()
    )
    rows = list(ahead.values_list("pk", "schedule_id", "scheduled_for"))
    if not rows:
        return {}
    Execution.objects.filter(pk__in=[pk for pk, _, _ in rows], status=Status.PENDING).delete()
    withdrawn: dict[int, tuple[datetime, int]] = {}
    for _, schedule_id, slot in rows:
        earliest, count = withdrawn.get(schedule_id, (slot, 0))
        withdrawn[schedule_id] = (min(earliest, slot), count + 1)
    return withdrawn


def cancel_in_flight(schedule_ids: list[int], *, reason: str, now: datetime) -> list[str]:
    """Record the in-flight executions of these schedules ``cancelled``; return their Celery task ids.

    Never waits for a lock another transaction holds on one of them (a
    body's ``atomic()`` around ``checkpoint()``, a publisher's batch, a
    worker recording an outcome; PostgreSQL, where rows lock): it raises
    ``InFlightLocked`` naming those schedules instead, having cancelled
    nothing, and the caller leaves them for later.
    """
    if not schedule_ids:
        return []
    in_flight = Execution.objects.filter(schedule_id__in=schedule_ids, status__in=Execution.IN_FLIGHT_STATUSES)
    with transaction.atomic():
        mine = set(in_flight.select_for_update(skip_locked=True, no_key=True).values_list("pk", flat=True))
        rows = list(in_flight.values_list("pk", "schedule_id", "celery_task_id"))
        locked = sorted({schedule_id for pk, schedule_id, _ in rows if pk not in mine})
        if locked:
            raise InFlightLocked(schedule_ids=tuple(locked))
        _cancel(in_flight, reason=reason, now=now)
    return [task_id for _, _, task_id in rows if task_id]


def cancel_waiting(condition: Q, *, reason: str, now: datetime, batch_size: int = _BATCH) -> int:
    """Record ``cancelled`` the waiting (pending, queued, retrying) executions ``condition`` matches; return how many.

    A batch at a time, each its own statement, so a drain of a long queue
    never locks it all at once; what runs already is left to finish.
    """
    cancelled = last = 0
    waiting = Execution.objects.filter(condition, status__in=Execution.WAITING_STATUSES)
    while True:
        ids = list(waiting.filter(pk__gt=last).order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            return cancelled
        last = ids[-1]
        cancelled += _move(
            Execution.objects.filter(pk__in=ids, status__in=Execution.WAITING_STATUSES),
            Status.CANCELLED,
            buffered=False,
            finished_at=now,
            claim_expires_at=None,
            error=reason,
        )


def routing_of(*, execution_id: Any = None, key: str | None = None) -> tuple[int, dict[str, str]] | None:
    """Return the id, and the task, queue and tenant (what pause rules match), of the execution named; ``None``: none."""
    rows = Execution.objects.filter(pk=execution_id) if key is None else Execution.objects.filter(idempotency_key=key)
    try:
        found = rows.values_list("pk", "task", "queue", "tenant").first()
    except (ValueError, TypeError):  # a header that is not an id: the claim refuses the message
        return None
    if found is None:
        return None
    pk, task, queue, tenant = found
    return pk, {"task": task, "queue": queue, "tenant": tenant}


def held_rows(condition: Q, *, queued_before: datetime) -> list[dict[str, Any]]:
    """The executions ``condition`` matches ``queued`` before ``queued_before``, as ``message_rows``: what a lifted hold sends again."""
    waited = Q(enqueued_at__isnull=True) | Q(enqueued_at__lt=queued_before)
    return message_rows(Execution.objects.filter(condition, waited, status=Status.QUEUED))


def _cancel(rows: QuerySet[Execution], *, reason: str, now: datetime) -> int:
    in_flight = rows.filter(status__in=Execution.IN_FLIGHT_STATUSES)
    return _move(in_flight, Status.CANCELLED, buffered=False, finished_at=now, claim_expires_at=None, error=reason)


# --- outcomes and run counters ----------------------------------------------------------


def _record_outcome(
    write: Callable[[], int],
    schedule_id: int | None,
    started_at: datetime | None,
    *,
    status: str,
    error: str = "",
    execution_id: int | None = None,
) -> bool:
    """Write the final ``status`` with ``write`` (a conditional UPDATE); count it on the schedule when written.

    A failure (``failed``, ``timed_out``) of ``execution_id`` records its
    notifications in the same transaction (``owners.notifications``), and so
    does the circuit breaker's pause it caused.
    """
    notify = execution_id is not None and status in (Status.FAILED, Status.TIMED_OUT)
    if schedule_id is None and not notify:  # one statement: the common ad-hoc path stays cheap
        return bool(write())
    with transaction.atomic():
        # Schedule row first, then the execution: the leader's order (module docstring).
        if schedule_id is not None and not (
            Schedule.objects.select_for_update().filter(pk=schedule_id).values_list("pk", flat=True).first()
        ):
            schedule_id = None  # the schedule was deleted
        finished = write()
        failpoint("outcome.in_transaction")
        tripped = False
        if finished and schedule_id is not None:
            tripped = schedules.count_run(schedule_id, status=status, error=error, started_at=started_at)
        if finished and notify:
            notifications.record_failure(execution_id)  # type: ignore[arg-type]  # notify: not None
        if tripped and schedule_id is not None and execution_id is not None:  # a failure trips it, so one is named
            notifications.record_paused(schedule_id, execution_id=execution_id)
    return bool(finished)


#: What a final status writes besides the status (``result``, ``error`` and ``traceback`` come with it).
_FINISHED = {"finished_at": Now(), "claim_expires_at": None}


def _finish_rows(rows: QuerySet[Execution], status: str, result: Any, error: str, traceback_text: str) -> int:
    assert status in Execution.FINAL_STATUSES, status
    return _move(rows, status, **_FINISHED, result=result, error=error, traceback=traceback_text)


def _finish_held(
    held: Claim, status: str, result: Any, error: str, traceback_text: str, celery_row: dict[str, Any] | None = None
) -> int:
    """``_finish_rows`` of ``held.rows()``, by the statement compiled once per status (the worker's path).

    With ``celery_row``, the TaskResult row is written only if the outcome
    is: on PostgreSQL by the same statement, elsewhere in its transaction.
    """
    assert status in Execution.FINAL_STATUSES, status
    values = {
        "id": held.execution_id,
        "attempt": held.attempt,
        "result": result,
        "error": error,
        "traceback": traceback_text,
    }
    using = Execution.objects.db
    if celery_row is None:
        return _FINISH.execute(using, (status,), values)
    values |= celery_result.params(celery_row)
    if connections[using].vendor == "postgresql":
        return int(_FINISH_STORING.execute(using, (status,), values) is not None)
    with transaction.atomic(using=using):
        finished = _FINISH.execute(using, (status,), values)
        if finished:
            _STORE.execute(using, (), values)
    return finished


def _held_rows() -> QuerySet[Execution]:
    """``Claim.rows()`` with the claim's id and attempt as ``Param``s."""
    return Execution.objects.filter(
        pk=Param("id", Execution._meta.pk), attempt=Param("attempt", _field("attempt")), status=Status.RUNNING
    )


def _finish_sql(using: str, status: str) -> tuple[str, list[Any]]:
    return _update_sql(
        _moving(_held_rows(), status),
        using,
        status=status,
        **_FINISHED,
        result=Param("result", _field("result")),
        error=Param("error", _field("error")),
        traceback=Param("traceback", _field("traceback")),
    )


def _result_sql(using: str) -> tuple[str, list[Any]]:
    succeeded = Execution.objects.filter(
        pk=Param("id", Execution._meta.pk), attempt=Param("attempt", _field("attempt")), status=Status.SUCCEEDED
    )
    return _update_sql(succeeded, using, result=Param("result", _field("result")))


def _finish_storing_sql(using: str, status: str) -> tuple[str, list[Any]]:
    """``_finish_sql`` and, if it finished the execution, Celery's result row: one statement (PostgreSQL)."""
    finish_sql, finish_params = _finish_sql(using, status)
    store_sql, store_params = celery_result.upsert_sql(using, when="EXISTS (SELECT 1 FROM finished)")
    return f"WITH finished AS ({finish_sql} RETURNING 1) {store_sql}", [*finish_params, *store_params]


_FINISH = Prepared(_finish_sql)
_FINISH_STORING = Prepared(_finish_storing_sql)
_STORE = Prepared(lambda using: celery_result.upsert_sql(using, when="1 = 1"))
_RESULT = Prepared(_result_sql)


def delete(ids: list[int]) -> int:
    """Delete the executions ``ids`` (their re-runs stay, no longer pointing at them); return how many went.

    Two statements, no row read into this process: Django's ``delete()``
    would load every row first, keeping a caller's locks for as long.
    """
    Execution.objects.filter(retry_of__in=ids).update(retry_of=None)
    with transaction.get_connection().cursor() as cursor:
        cursor.execute(f"DELETE FROM {Execution._meta.db_table} WHERE id IN ({', '.join(['%s'] * len(ids))})", ids)
        return cursor.rowcount


# --- helpers ------------------------------------------------------------------------------


def _move(rows: QuerySet[Execution], to: str, **fields: Any) -> int:
    """Move ``rows`` to status ``to`` where ``Execution.TRANSITIONS`` allows it; return how many moved."""
    return _moving(rows, to).update(status=to, **fields)


def _moving(rows: QuerySet[Execution], to: str) -> QuerySet[Execution]:
    """Those of ``rows`` that ``Execution.TRANSITIONS`` lets move to ``to``: every status write filters so."""
    return rows.filter(status__in=Execution.moves_to(to))


def _update_sql(rows: QuerySet[Execution], using: str, **fields: Any) -> tuple[str, list[Any]]:
    """The SQL and parameters of ``rows.update(**fields)`` on ``using``, not run (``Prepared`` runs it)."""
    query = cast(UpdateQuery, rows.query.chain(UpdateQuery))
    query.add_update_values(fields)
    return query.get_compiler(using).as_sql()


def _field(name: str) -> Any:
    return Execution._meta.get_field(name)


def _db_now_plus(seconds: float) -> ExpressionWrapper:
    """The database clock plus ``seconds``, as an expression (no local clock involved)."""
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())

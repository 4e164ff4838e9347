"""executions.insert (scheduler.fastpath.bulk_insert): the rows bulk_create wrote, conflicts ignored, at a lower cost.

A Django or driver internal gone or changed inserts by ``bulk_create``, with one warning and one count.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import time_machine
from django.db import IntegrityError, connection, models
from django.db.models import Value
from django.db.models.functions import Upper

from scheduler import dbclock
from scheduler.fastpath import bulk_insert, cursors
from scheduler.fastpath.guard import FastPath
from scheduler.models import Execution, Schedule, tally
from scheduler.owners import executions, schedules
from tests.integration.fastpath_support import fallback_warnings, fallbacks_counted, fresh
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
AT = datetime(2026, 3, 29, 1, 30, 15, 123456, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def fast_path(monkeypatch: pytest.MonkeyPatch) -> FastPath:
    """The insert's fast path as a new process has it: not yet checked."""
    return fresh(monkeypatch, bulk_insert)


def schedule(name: str = "nightly", **fields: Any) -> Schedule:
    return make_schedule(name, interval=3600, start_at=AT, next_run_at=AT, **fields)


def varied_rows(prefix: str, source: Schedule, earlier: Execution) -> list[Execution]:
    """Rows as every caller builds them, covering each column's kinds of value."""
    build = executions.execution_for
    rows = [
        build(source, AT, status=Status.PENDING, now=AT, token=2**40),
        build(source, AT - timedelta(hours=1), status=Status.MISSED, now=AT, token=3),
        build(source, AT - timedelta(hours=2), status=Status.SKIPPED, now=AT),
        build(source, AT + timedelta(hours=1), status=Status.PENDING, now=AT, buffered=True, token=7),
        Execution(
            idempotency_key="ad-hoc",
            trigger=Execution.Trigger.SUBMIT,
            task="scheduler.echo",
            args=[1, "zwei", None, 3.5, {"nested": ["ü", True]}],
            kwargs={"quote": 'say "hi"\\n', "emoji": "\N{SNOWMAN}", "empty": {}},
            queue="slow",
            priority=9,
            scheduled_for=AT.astimezone(timezone(timedelta(hours=2))),  # aware, not UTC
            status="queued",  # a plain string, where dispatch passes a Status member
            timeout=30,
            max_retries=2,
            retry_backoff=5,
            celery_task_id="ad-hoc-task",
            tenant="acme",
            worker="w@host",
            result={"value": 1},
            progress=[],
            error="boom\nline two",
            attempt_errors=[{"attempt": 1, "error": "x", "at": AT.isoformat()}],
            retry_of=earlier,
        ),
    ]
    for number, row in enumerate(rows):
        row.idempotency_key = f"{prefix}{row.idempotency_key}"
        if row.celery_task_id:  # a fresh uuid4 for pending rows: the same in both copies instead
            row.celery_task_id = f"task-{number}"
    return rows


def stored(prefix: str) -> list[tuple[Any, ...]]:
    """Every column of the rows whose key starts with ``prefix``, as the database returns it, but id and key."""
    table = Execution._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {table} WHERE idempotency_key LIKE %s ORDER BY idempotency_key", [f"{prefix}%"])
        names = [column[0] for column in cursor.description]
        rows = cursor.fetchall()
    # created_at is the database's clock on insert's rows, bulk_create's own clock on its (see below).
    skipped = {"id", "idempotency_key", "created_at"}
    return [tuple((name, value) for name, value in zip(names, row) if name not in skipped) for row in rows]


def test_insert__writes_every_column_as_bulk_create_wrote_it(fast_path: FastPath) -> None:
    # Given rows of every kind, built twice
    source = schedule(args=["a", 1], kwargs={"k": [1, 2]}, queue="q", priority=3, timeout=60, tenant="acme")
    earlier = Execution.objects.create(idempotency_key="earlier", task="scheduler.echo", scheduled_for=AT)
    before = dbclock.now()
    with time_machine.travel(AT + timedelta(seconds=5), tick=False):  # this process's clock, far from the database's
        # When one copy goes through bulk_create and the other through insert
        Execution.objects.bulk_create(varied_rows("a:", source, earlier), ignore_conflicts=True)
        inserted = varied_rows("b:", source, earlier)
        executions.insert(inserted)
    after = dbclock.now()

    # Then the database holds the same values, column by column, in the same representation
    expected, got = stored("a:"), stored("b:")
    assert len(got) == 5
    for want, have in zip(expected, got, strict=True):
        assert have == want
    # by the fast path, which the self-check found alike bulk_create
    assert not fast_path.fallen
    # But for created_at: the database's clock for insert, this process's for bulk_create
    created = Execution.objects.filter(idempotency_key__startswith="b:").values_list("created_at", flat=True)
    assert all(before <= at <= after for at in created)
    assert set(Execution.objects.filter(idempotency_key__startswith="a:").values_list("created_at", flat=True)) == {
        AT + timedelta(seconds=5)
    }


def test_insert__ignores_rows_whose_key_exists() -> None:
    # Given an execution already recorded for a slot
    source = schedule()
    first = executions.execution_for(source, AT, status=Status.PENDING, now=AT)
    executions.insert([first])
    before = Execution.objects.values().get(idempotency_key=first.idempotency_key)

    # When the same slot and a new one are inserted
    again = executions.execution_for(source, AT, status=Status.MISSED, now=AT)
    later = executions.execution_for(source, AT + timedelta(hours=1), status=Status.PENDING, now=AT)
    executions.insert([again, later])

    # Then the existing row is untouched and only the new slot is added
    assert Execution.objects.values().get(idempotency_key=first.idempotency_key) == before
    assert Execution.objects.count() == 2
    assert Execution.objects.get(idempotency_key=later.idempotency_key).status == Status.PENDING


def test_insert__more_rows_than_one_batch() -> None:
    # Given more rows than one statement takes
    source = schedule()
    rows = [
        executions.execution_for(source, AT + timedelta(hours=hour), status=Status.PENDING, now=AT)
        for hour in range(2_500)
    ]

    # When they are inserted
    executions.insert(rows)

    # Then every one is stored, each with its own slot and Celery task id
    assert Execution.objects.count() == 2_500
    assert len(set(Execution.objects.values_list("celery_task_id", flat=True))) == 2_500
    assert Execution.objects.order_by("scheduled_for").last().scheduled_for == AT + timedelta(hours=2_499)


def test_insert__final_rows_are_tallied_by_the_trigger() -> None:
    # Given a schedule with nothing tallied yet
    source = schedule()

    # When missed and skipped rows are inserted, one of them twice (ignored the second time)
    missed = executions.execution_for(source, AT - timedelta(hours=1), status=Status.MISSED, now=AT)
    executions.insert([missed])
    executions.insert(
        [
            executions.execution_for(source, AT - timedelta(hours=1), status=Status.MISSED, now=AT),
            executions.execution_for(source, AT - timedelta(hours=2), status=Status.MISSED, now=AT),
            executions.execution_for(source, AT - timedelta(hours=3), status=Status.SKIPPED, now=AT),
            executions.execution_for(source, AT, status=Status.PENDING, now=AT),
        ]
    )

    # Then the database's trigger counted each stored final row once, and the pending one not at all
    counts = tally.execution_counts()
    counted = {
        status: counts.get((status, "scheduler.echo", Execution.Trigger.SCHEDULED), 0)
        for status in (Status.MISSED, Status.SKIPPED, Status.PENDING)
    }
    assert counted == {Status.MISSED: 2, Status.SKIPPED: 1, Status.PENDING: 0}


def test_insert__unsaved_schedule_is_refused_and_nothing_written() -> None:
    # Given a row of a schedule that was never saved
    unsaved = Schedule(name="unsaved", task="scheduler.echo", interval=60, start_at=AT)
    row = Execution(idempotency_key="k", task="scheduler.echo", scheduled_for=AT, schedule=unsaved)

    # When it is inserted, then it is refused as bulk_create refuses it
    with pytest.raises(ValueError, match="unsaved related object 'schedule'"):
        executions.insert([row])
    assert not Execution.objects.exists()


def test_insert__schedule_saved_after_assignment_gives_its_id() -> None:
    # Given a row built before its schedule was saved
    source = Schedule(name="late", task="scheduler.echo", interval=60, start_at=AT)
    row = Execution(idempotency_key="k", task="scheduler.echo", scheduled_for=AT, schedule=source)
    schedules.save(source)

    # When it is inserted
    executions.insert([row])

    # Then it belongs to the schedule, as with bulk_create
    assert Execution.objects.get(idempotency_key="k").schedule_id == source.pk


@pytest.mark.parametrize(
    "broken",
    [pytest.param({"task": None}, id="not-null"), pytest.param({"attempt": -1}, id="check")],
)
def test_insert__a_row_breaking_another_constraint_raises_and_nothing_is_written(broken: dict[str, Any]) -> None:
    # Given a batch of good rows and one that breaks a NOT NULL or CHECK constraint (not the key)
    source = schedule()
    rows = [
        executions.execution_for(source, AT + timedelta(hours=hour), status=Status.PENDING, now=AT) for hour in range(3)
    ]
    for name, value in broken.items():
        setattr(rows[1], name, value)

    # When the batch is inserted, Then the database's error propagates: only a duplicate key is ignored
    with pytest.raises(IntegrityError):
        executions.insert(rows)
    # And nothing of the batch is stored
    assert not Execution.objects.exists()


def test_insert__returns_the_keys_it_stored() -> None:
    # Given a slot that already has an execution
    source = schedule()
    executions.insert([executions.execution_for(source, AT, status=Status.PENDING, now=AT)])

    # When it is inserted again beside two new slots
    rows = [
        executions.execution_for(source, AT + timedelta(hours=hour), status=Status.PENDING, now=AT) for hour in range(3)
    ]
    inserted = executions.insert(rows)

    # Then only the two rows actually stored are reported
    assert inserted == {rows[1].idempotency_key, rows[2].idempotency_key}


def test_record_ad_hoc__a_row_breaking_another_constraint_raises() -> None:
    # Given a plain Celery call whose row breaks a NOT NULL constraint (not the key)
    call = {"task": "scheduler.echo", "args": (), "kwargs": {}, "queue": None, "timeout": None, "now": AT}

    # When it is recorded, Then the database's error propagates and nothing is stored
    with pytest.raises(IntegrityError):
        executions.record_ad_hoc("celery-1", **call)
    assert not Execution.objects.exists()
    # And the same call recorded twice with its queue stores one row
    call["queue"] = ""
    assert executions.record_ad_hoc("celery-1", **call) == executions.record_ad_hoc("celery-1", **call)
    assert Execution.objects.count() == 1


def _slots(source: Schedule, count: int) -> list[Execution]:
    return [
        executions.execution_for(source, AT + timedelta(hours=n), status=Status.PENDING, now=AT) for n in range(count)
    ]


def test_field_preparation_changed__self_check_inserts_by_bulk_create(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Given a Django whose CharField now strips its values, which the fast path passes by as they are
    original = models.CharField.get_prep_value
    monkeypatch.setattr(
        models.CharField,
        "get_prep_value",
        lambda field, value: None if value is None else original(field, value).strip(),
    )
    source = schedule()
    rows = _slots(source, 3)
    for row in rows:
        row.task = "scheduler.echo  "
    # When the rows are recorded, and then recorded again
    created = executions.record(rows)
    again = executions.record(_slots(source, 4))
    # Then the self-check found the difference before anything was written: bulk_create stored them,
    # as Django prepares them now, and the second time only the new key
    assert fast_path.fallen
    assert len(created) == 3
    assert set(Execution.objects.values_list("task", flat=True)) == {"scheduler.echo"}
    assert len(again) == 1 and Execution.objects.count() == 4
    # and the fallback was logged once, naming the column, and counted once
    [warning] = fallback_warnings(caplog)
    assert "task" in warning.getMessage()
    assert fallbacks_counted("bulk_insert") == 1


def test_driver_internal_gone__inserts_by_bulk_create(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Given a database driver without what the fast path builds on: psycopg's Cursor class
    # (PostgreSQL), sqlite3's SQLITE_LIMIT_VARIABLE_NUMBER (SQLite); Django's own backend holds on to its
    if connection.vendor == "postgresql":
        cursors._cursor_class.cache_clear()
        monkeypatch.delattr(psycopg, "Cursor")
    else:
        monkeypatch.delattr(sqlite3, "SQLITE_LIMIT_VARIABLE_NUMBER")
    source = schedule()
    rows = _slots(source, 3)
    # When rows are recorded twice, the second time with one taken key and one new
    try:
        created = executions.record(rows)
        again = executions.record([*_slots(source, 2)[1:], *_slots(source, 4)[3:]])
    finally:
        cursors._cursor_class.cache_clear()  # built again with the driver as it is
    # Then every row is stored by bulk_create, a taken key once only
    assert fast_path.fallen
    assert len(created) == 3 and len(again) == 1
    assert Execution.objects.count() == 4
    # and the fallback was logged once and counted once
    [warning] = fallback_warnings(caplog)
    assert "bulk_insert" in warning.getMessage()
    assert fallbacks_counted("bulk_insert") == 1


@pytest.mark.parametrize(
    "broken",
    [pytest.param({"task": None}, id="not-null"), pytest.param({"attempt": -1}, id="check")],
)
def test_slow_path__a_row_breaking_another_constraint_raises(fast_path: FastPath, broken: dict[str, Any]) -> None:
    # Given the slow path (a process that fell back), and a batch with a row that breaks another constraint
    fast_path.fall_back("a test")
    rows = _slots(schedule(), 3)
    for name, value in broken.items():
        setattr(rows[1], name, value)
    # When the rows are inserted, Then it raises, as the fast path does
    with pytest.raises(IntegrityError):
        executions.insert(rows)


def test_insert__an_expression_for_a_value_raises_and_does_not_fall_back(fast_path: FastPath) -> None:
    # Given a row with an expression where a value goes
    row = _slots(schedule(), 1)[0]
    row.task = Upper(Value("scheduler.echo"))  # type: ignore[assignment]  # the mistake under test
    # When it is inserted, Then the caller's mistake is raised, and the fast path stays
    with pytest.raises(TypeError, match="not expressions"):
        executions.insert([row])
    assert not fast_path.fallen

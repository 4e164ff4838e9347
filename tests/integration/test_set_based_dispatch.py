"""The set-based dispatch path commits exactly what the general path commits, for every schedule it takes.

Two identical sets of schedules, each dispatched by one pass: the first
with the set-based path turned off (``dispatch.SET_BASED``), the second
with it on. Every column of every execution row and of every schedule row
must come out the same, but for what names the row itself (ids, names,
keys' schedule ids, the Celery task id, the time the row was written).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest

from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

#: Columns that name the row or its moment of writing, not what was decided.
EXECUTION_OWN = {"id", "idempotency_key", "schedule_id", "celery_task_id", "created_at"}
SCHEDULE_OWN = {"id", "name", "created_at", "updated_at"}
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def variants(now: datetime) -> dict[str, dict[str, Any]]:
    """The fields of schedules the set-based path takes, each due at ``now`` with its first slot."""
    start = now - timedelta(seconds=5)
    return {
        "hourly": {"interval": 3600, "start_at": start},
        "odd microseconds": {"interval": 600, "start_at": now - timedelta(seconds=3, microseconds=250_001)},
        "whole second": {"interval": 120, "start_at": start.replace(microsecond=0)},
        "message options": {
            "interval": 900,
            "start_at": start,
            "args": [1, "two", {"three": 3}],
            "kwargs": {"customer": 42, "tags": ["a", "b"]},
            "queue": "reports",
            "priority": 7,
            "timeout": 30,
            "max_retries": 3,
            "retry_backoff": 5,
            "jitter": 10,
            "tenant": "acme",
        },
        "misfire skip, on time": {"interval": 3600, "start_at": now - timedelta(seconds=1), "misfire": "skip"},
        "run once": {"interval": 3600, "start_at": start, "misfire": "run_once"},
        "one-off": {"run_at": now - timedelta(seconds=2)},
        "one-off, odd microseconds": {"run_at": now - timedelta(seconds=1, microseconds=7)},
    }


def make_set(prefix: str, now: datetime) -> dict[str, Schedule]:
    """The variants, saved as of 10 s before ``now``: each one's next slot is its first."""
    return {
        label: make_schedule(f"{prefix} {label}", now=now - timedelta(seconds=10), **fields)
        for label, fields in variants(now).items()
    }


def take_slots(made: dict[str, Schedule]) -> None:
    """A backfill got there first: the slot of one interval and one one-off already has its execution."""
    for label in ("run once", "one-off"):
        schedule = Schedule.objects.get(pk=made[label].pk)
        make_execution(f"schedule:{schedule.pk}:{schedule.next_run_at.isoformat()}", schedule=schedule)


def outcome(made: dict[str, Schedule]) -> dict[str, Any]:
    """Every column of each schedule and of its executions, but those naming the row."""
    result = {}
    for label, schedule in made.items():
        row = Schedule.objects.filter(pk=schedule.pk).values().get()
        executions = list(Execution.objects.filter(schedule_id=schedule.pk).order_by("scheduled_for").values())
        for execution in executions:
            key = execution["idempotency_key"]
            assert key.startswith(f"schedule:{schedule.pk}:"), key
            execution["slot"] = key.removeprefix(f"schedule:{schedule.pk}:")
            if execution["lease_token"] is not None:  # the beat's (a backfill's row has no task id yet)
                assert UUID4.match(execution["celery_task_id"]), execution["celery_task_id"]
        result[label] = {
            "schedule": {name: value for name, value in row.items() if name not in SCHEDULE_OWN},
            "executions": [
                {name: value for name, value in execution.items() if name not in EXECUTION_OWN}
                for execution in executions
            ],
        }
    return result


def dispatch_with(
    set_based: bool, lease: leases.LeaseHandle, monkeypatch: pytest.MonkeyPatch
) -> dispatch.DispatchReport:
    monkeypatch.setattr(dispatch, "SET_BASED", set_based)
    planned, _ = dispatch._plan(now=dbclock.now(), batch_size=500, shards=None)
    paths = {type(item) for item in planned}
    assert paths == ({dispatch._Slot} if set_based else {dispatch._Planned}), paths
    return dispatch.dispatch_due(lease)


def test_set_based_and_general_paths_commit_the_same_rows(
    lease: leases.LeaseHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (both passes run at the same instant of the database clock, so they decide from the same now)
    now = dbclock.now()
    monkeypatch.setattr(dbclock, "now", lambda: now)
    # Given a set of schedules dispatched by the general path
    general = make_set("general", now)
    take_slots(general)
    general_report = dispatch_with(False, lease, monkeypatch)
    # and the same set dispatched by the set-based path
    set_based = make_set("set-based", now)
    take_slots(set_based)
    set_based_report = dispatch_with(True, lease, monkeypatch)

    # Then both wrote the same execution and schedule rows
    expected, got = outcome(general), outcome(set_based)
    for label in variants(now):
        assert got[label] == expected[label], label
    assert all(entry["executions"] for entry in got.values())
    # and reported the same fires and completions
    assert sorted((name.removeprefix("general "), slot) for name, slot in general_report.fired) == sorted(
        (name.removeprefix("set-based "), slot) for name, slot in set_based_report.fired
    )
    assert sorted((name.removeprefix("general "), why) for name, why in general_report.completed) == sorted(
        (name.removeprefix("set-based "), why) for name, why in set_based_report.completed
    )
    assert general_report.schedules == set_based_report.schedules == len(variants(now))


def test_schedules_the_set_based_path_leaves_take_the_general_path(lease: leases.LeaseHandle) -> None:
    # Given due schedules each with one thing only the general path decides
    now = dbclock.now()
    start = now - timedelta(seconds=5)
    interval = {"interval": 3600, "start_at": start}
    others = [
        make_schedule("cron", cron="* * * * *"),
        make_schedule("overlap", overlap="skip", **interval),
        make_schedule("capped", max_runs=3, **interval),
        make_schedule("ends", end_at=now + timedelta(days=1), **interval),
        make_schedule("two slots due", interval=2, start_at=now - timedelta(seconds=10)),
        make_schedule("late for skip", misfire="skip", **interval),
        make_schedule("past its catch-up window", catchup_window=1, **interval),
        make_schedule("zone gone from tzdata", **interval),
    ]
    Schedule.objects.filter(pk__in=[schedule.pk for schedule in others]).update(next_run_at=start)
    Schedule.objects.filter(name="zone gone from tzdata").update(timezone="Gone/Away")
    Schedule.objects.filter(name="two slots due").update(next_run_at=now - timedelta(seconds=4))

    # When the pass plans them
    planned, _ = dispatch._plan(now=dbclock.now(), batch_size=500, shards=None)

    # Then every one is planned by the policies, not set-based
    assert {item.pk: type(item) for item in planned} == {schedule.pk: dispatch._Planned for schedule in others}

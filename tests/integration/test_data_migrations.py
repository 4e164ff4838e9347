"""The migrations that fill existing rows, each run on a database filled at the migration before it.

Each test migrates the test database back to the migration before the one
under test, writes rows as that schema had them (historical models), runs
the migration, and reads what it filled. The fixture migrates forward to
the newest migration afterwards, whatever the test did. (0015 and 0020 have
their own modules: test_tenant_binding_migration.py, test_group_names_migration.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.support.schema_migrations import migrate_to, migrate_to_newest

pytestmark = pytest.mark.django_db(transaction=True)

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
Migrate = Callable[[str], Any]


@pytest.fixture
def migrate() -> Iterator[Migrate]:
    """``migrate("0007_...")`` moves the schema to that migration and returns its historical apps."""
    yield lambda name: migrate_to([("scheduler", name)])
    migrate_to_newest()


def _schedule(apps: Any, name: str, **fields: Any) -> Any:
    Schedule = apps.get_model("scheduler", "Schedule")
    fields = {"task": "tests.record", "interval": 60, "next_run_at": T0, "timezone": "UTC", **fields}
    return Schedule.objects.create(name=name, **fields)


def _execution(apps: Any, key: str, **fields: Any) -> Any:
    Execution = apps.get_model("scheduler", "Execution")
    fields = {"task": "tests.record", "scheduled_for": T0, "status": "succeeded", **fields}
    return Execution.objects.create(idempotency_key=key, **fields)


def _tallied(apps: Any) -> dict[str, int]:
    """Return the executions the tally rows count, by status (summed over their other keys)."""
    Tally = apps.get_model("scheduler", "ExecutionTally")
    counts: dict[str, int] = {}
    for status, count in Tally.objects.values_list("status", "count"):
        counts[status] = counts.get(status, 0) + count
    return counts


def test_0008__slots_sent_counts_the_beats_own_rows_and_owed_since_starts_at_creation(migrate: Migrate) -> None:
    # Given, before 0008: a limited schedule with two fired slots, a missed one and a run-now, and an unlimited one
    apps = migrate("0007_admin_scale_indexes")
    limited = _schedule(apps, "limited", max_runs=10)
    unlimited = _schedule(apps, "unlimited")
    for minute, status in ((0, "succeeded"), (1, "failed"), (2, "missed")):
        slot = T0 + timedelta(minutes=minute)
        _execution(
            apps, f"schedule:{limited.pk}:{slot.isoformat()}", schedule_id=limited.pk, scheduled_for=slot, status=status
        )
    _execution(apps, f"schedule:{limited.pk}:manual:abc", schedule_id=limited.pk)
    _execution(apps, f"schedule:{unlimited.pk}:{T0.isoformat()}", schedule_id=unlimited.pk)
    # When 0008 runs
    apps = migrate("0008_counters_and_priority")
    # Then slots_sent counts the slots the beat sent (not missed, not run-now), for limited schedules
    Schedule = apps.get_model("scheduler", "Schedule")
    rows = {s.name: s for s in Schedule.objects.all()}
    assert rows["limited"].slots_sent == 2
    assert rows["unlimited"].slots_sent == 0
    assert all(s.owed_since == s.created_at for s in rows.values())


def test_0010__each_existing_execution_gets_the_trigger_its_key_shows(migrate: Migrate) -> None:
    # Given, before 0010: executions of every kind, told apart only by their keys
    apps = migrate("0009_execution_checkpoint")
    schedule = _schedule(apps, "s")
    keys = {
        f"schedule:{schedule.pk}:{T0.isoformat()}": "scheduled",
        f"schedule:{schedule.pk}:manual:1": "manual",
        "retry:7:2": "retry",
        "submit:abc": "submit",
        "celery:abc": "submit",
        "callers-own-key": "submit",
    }
    for key in keys:
        _execution(apps, key, schedule_id=None if key == "callers-own-key" else schedule.pk)
    # When 0010 runs
    apps = migrate("0010_execution_trigger")
    # Then
    Execution = apps.get_model("scheduler", "Execution")
    assert dict(Execution.objects.values_list("idempotency_key", "trigger")) == keys


def test_0012__tallies_start_from_the_final_executions_and_schedules_learn_their_last_success(
    migrate: Migrate,
) -> None:
    # Given, before 0012: a schedule with two successes, a failure and one still running
    apps = migrate("0011_api_tokens_and_audit")
    schedule = _schedule(apps, "s")
    for n, status in enumerate(("succeeded", "succeeded", "failed", "running")):
        finished = T0 + timedelta(minutes=n, seconds=2) if status != "running" else None
        _execution(
            apps,
            f"k{n}",
            schedule_id=schedule.pk,
            status=status,
            started_at=T0 + timedelta(minutes=n),
            finished_at=finished,
        )
    # When 0012 runs
    apps = migrate("0012_observability")
    # Then the counters hold the three final executions, and the schedule its newest success
    assert _tallied(apps) == {"succeeded": 2, "failed": 1}
    Schedule = apps.get_model("scheduler", "Schedule")
    assert Schedule.objects.get(pk=schedule.pk).last_success_at == T0 + timedelta(minutes=1, seconds=2)
    # And an execution that becomes final afterwards is counted by the trigger
    Execution = apps.get_model("scheduler", "Execution")
    Tally = apps.get_model("scheduler", "ExecutionTally")
    Execution.objects.filter(idempotency_key="k3").update(status="succeeded", finished_at=T0 + timedelta(minutes=4))
    assert sum(Tally.objects.filter(status="succeeded").values_list("count", flat=True)) == 3


def test_0019__totals_kept_new_finals_appended_and_the_way_back_folds_them(migrate: Migrate) -> None:
    # Given, before 0019: a final execution already counted in the totals
    apps = migrate("0018_schedule_pruned_through")
    _execution(apps, "done", started_at=T0, finished_at=T0 + timedelta(seconds=1))
    Tally = apps.get_model("scheduler", "ExecutionTally")
    assert sum(Tally.objects.filter(status="succeeded").values_list("count", flat=True)) == 1
    # When 0019 runs, and another execution becomes final
    apps = migrate("0019_tally_increments")
    _execution(apps, "running", status="running", started_at=T0)
    Execution = apps.get_model("scheduler", "Execution")
    Execution.objects.filter(idempotency_key="running").update(status="failed", finished_at=T0 + timedelta(seconds=3))
    # Then the totals are as they were, and the new final is an increment
    Tally = apps.get_model("scheduler", "ExecutionTally")
    Increment = apps.get_model("scheduler", "TallyIncrement")
    assert sum(Tally.objects.values_list("count", flat=True)) == 1
    assert list(Increment.objects.values_list("status", flat=True).distinct()) == ["failed"]
    # And migrating back folds the increments into the totals, so nothing counted is lost
    apps = migrate("0018_schedule_pruned_through")
    assert _tallied(apps) == {"succeeded": 1, "failed": 1}

"""``import_celery_beat``: django-celery-beat's periodic tasks become schedules, or are refused with the reason.

django-celery-beat is installed for the tests only (requirements-dev.txt,
``TEST_CELERY_BEAT_TABLES`` in tests/support/env_defaults.py); its own models write
the rows the command then reads with SQL.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from celery.schedules import crontab
from django.db import connection
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    SolarSchedule,
)
from django_celery_beat.schedulers import ModelEntry

from project.celery import app
from scheduler.models import Schedule
from scheduler.owners import schedules
from tests.integration import command_support

pytestmark = pytest.mark.django_db

START = datetime(2030, 5, 1, tzinfo=timezone.utc)
EXPIRES = datetime(2030, 12, 31, tzinfo=timezone.utc)
CLOCKED = datetime(2030, 7, 1, 8, 0, tzinfo=timezone.utc)

#: Name -> the line the import prints for it (a first run, not a dry run).
EXPECTED_LINES = {
    "bad-cron": "bad-cron: refused: cron: Invalid cron expression '61 * * * *': minute field '61' is out of range 0-59",
    "celery.backend_cleanup": "celery.backend_cleanup: imported (cron 0 4 * * * in UTC)",
    "existing": "existing: exists (a schedule of that name is left alone)",
    "expiring-messages": "expiring-messages: imported (every 60s)",
    "first-monday": (
        "first-monday: refused: its crontab restricts both day of month (1) and day of week (1): "
        "Celery runs on days matching both, cron here on days matching either"
    ),
    "gone-task": "gone-task: refused: task: Unknown task 'myproject.gone': no task with that name is registered.",
    "launch": "launch: imported (once at 2030-07-01T08:00:00+00:00, disabled)",
    "nightly-report": "nightly-report: imported (cron 0 3 * * 1-5 in Europe/Berlin)",
    "poll-once": "poll-once: imported (every 120s, one-off)",
    "ran-once": (
        "ran-once: imported (every 30s, one-off, disabled); "
        "the one-off already ran in django-celery-beat, so it is imported disabled"
    ),
    "sub-second": (
        "sub-second: refused: its interval (every 500 microseconds) is not a positive whole number of seconds"
    ),
    "sunrise": "sunrise: refused: solar schedules (sunrise at 52.52, 13.405) have no equivalent here",
}


run = functools.partial(command_support.run, "import_celery_beat")
refused = functools.partial(command_support.refused, "import_celery_beat")


@pytest.fixture
def periodic_tasks() -> None:
    """Write one django-celery-beat task per case, through its own models."""

    def cron(
        minute: str = "*", hour: str = "*", day_of_month: str = "*", day_of_week: str = "*", tz: str = "UTC"
    ) -> CrontabSchedule:
        return CrontabSchedule.objects.create(
            minute=minute, hour=hour, day_of_month=day_of_month, day_of_week=day_of_week, month_of_year="*", timezone=tz
        )

    def every(count: int, period: str) -> IntervalSchedule:
        return IntervalSchedule.objects.create(every=count, period=period)

    PeriodicTask.objects.create(
        name="nightly-report",
        task="scheduler.echo",
        crontab=cron("0", "3", day_of_week="1-5", tz="Europe/Berlin"),
        args='[1, "two"]',
        kwargs='{"fmt": "pdf"}',
        queue="reports",
        priority=5,
        description="The nightly PDF.",
        start_time=START,
        expires=EXPIRES,
    )
    PeriodicTask.objects.create(
        name="poll-once",
        task="scheduler.echo",
        interval=every(2, IntervalSchedule.MINUTES),
        one_off=True,
        exchange="legacy",
        routing_key="legacy.poll",
        headers='{"trace": "on"}',
    )
    PeriodicTask.objects.create(
        name="launch",
        task="scheduler.echo",
        clocked=ClockedSchedule.objects.create(clocked_time=CLOCKED),
        one_off=True,
        enabled=False,
    )
    PeriodicTask.objects.create(
        name="ran-once",
        task="scheduler.echo",
        interval=every(30, IntervalSchedule.SECONDS),
        one_off=True,
        total_run_count=1,
    )
    # The entry django-celery-beat's DatabaseScheduler adds for itself, made
    # the way it makes it (celery.beat.Scheduler.install_default_entries).
    ModelEntry.from_entry(
        "celery.backend_cleanup",
        app=app,
        task="celery.backend_cleanup",
        schedule=crontab("0", "4", "*"),
        options={"expires": 12 * 3600},
    )
    PeriodicTask.objects.create(
        name="sunrise",
        task="scheduler.echo",
        solar=SolarSchedule.objects.create(event="sunrise", latitude=Decimal("52.52"), longitude=Decimal("13.405")),
    )
    PeriodicTask.objects.create(name="bad-cron", task="scheduler.echo", crontab=cron("61"))
    PeriodicTask.objects.create(
        name="first-monday", task="scheduler.echo", crontab=cron("0", "9", day_of_month="1", day_of_week="1")
    )
    PeriodicTask.objects.create(
        name="expiring-messages", task="scheduler.echo", interval=every(1, IntervalSchedule.MINUTES), expire_seconds=60
    )
    PeriodicTask.objects.create(
        name="sub-second", task="scheduler.echo", interval=every(500, IntervalSchedule.MICROSECONDS)
    )
    PeriodicTask.objects.create(name="gone-task", task="myproject.gone", interval=every(1, IntervalSchedule.HOURS))
    PeriodicTask.objects.create(name="existing", task="scheduler.echo", crontab=cron("0", "0"))
    schedules.create(name="existing", task="scheduler.sleep", interval=60)


def test_import_celery_beat__creates_what_has_an_equivalent_and_refuses_the_rest(periodic_tasks: None) -> None:
    # Given the periodic tasks of the fixture, and a schedule named "existing"

    # When they are imported
    lines = run().splitlines()

    # Then each gets its line, sorted by name, and a summary
    assert lines[:-1] == [EXPECTED_LINES[name] for name in sorted(EXPECTED_LINES)]
    assert lines[-1] == "6 imported, 1 exist(s), 5 refused (periodic tasks in database 'default')."
    assert set(Schedule.objects.values_list("name", flat=True)) == {
        "nightly-report",
        "poll-once",
        "launch",
        "ran-once",
        "expiring-messages",
        "celery.backend_cleanup",
        "existing",
    }
    # ... and everything with an equivalent carried over
    nightly = Schedule.objects.get(name="nightly-report")
    assert (nightly.task, nightly.cron, nightly.timezone, nightly.args, nightly.kwargs) == (
        "scheduler.echo",
        "0 3 * * 1-5",
        "Europe/Berlin",
        [1, "two"],
        {"fmt": "pdf"},
    )
    assert (nightly.queue, nightly.priority, nightly.description, nightly.enabled) == (
        "reports",
        5,
        "The nightly PDF.",
        True,
    )
    assert (nightly.start_at, nightly.end_at, nightly.max_runs) == (START, EXPIRES, None)
    poll = Schedule.objects.get(name="poll-once")
    assert (poll.interval, poll.max_runs, poll.enabled, poll.queue, poll.timezone) == (120, 1, True, "", "UTC")
    launch = Schedule.objects.get(name="launch")
    assert (launch.run_at, launch.cron, launch.interval, launch.max_runs, launch.enabled) == (
        CLOCKED,
        "",
        None,
        None,
        False,
    )
    ran_once = Schedule.objects.get(name="ran-once")
    assert (ran_once.interval, ran_once.max_runs, ran_once.enabled) == (30, 1, False)
    cleanup = Schedule.objects.get(name="celery.backend_cleanup")
    assert (cleanup.task, cleanup.cron, cleanup.timezone, cleanup.args, cleanup.kwargs, cleanup.end_at) == (
        "celery.backend_cleanup",
        "0 4 * * *",
        "UTC",
        [],
        {},
        None,
    )
    # ... and the schedule that existed is left alone
    existing = Schedule.objects.get(name="existing")
    assert (existing.task, existing.interval, existing.cron) == ("scheduler.sleep", 60, "")


def test_import_celery_beat__running_it_again_creates_nothing(periodic_tasks: None) -> None:
    # Given an import that has run
    run()
    before = {s.name: (s.pk, s.updated_at) for s in Schedule.objects.all()}

    # When it runs again
    lines = run().splitlines()

    # Then every imported task now exists, the refused ones are refused again, and no row changed
    assert lines[-1] == "0 imported, 7 exist(s), 5 refused (periodic tasks in database 'default')."
    assert "poll-once: exists (a schedule of that name is left alone)" in lines
    assert EXPECTED_LINES["sunrise"] in lines
    assert {s.name: (s.pk, s.updated_at) for s in Schedule.objects.all()} == before


def test_import_celery_beat__dry_run_writes_nothing(periodic_tasks: None) -> None:
    # When the import is a dry run
    lines = run("--dry-run").splitlines()

    # Then it says what it would import and creates nothing
    assert "nightly-report: would be imported (cron 0 3 * * 1-5 in Europe/Berlin)" in lines
    assert EXPECTED_LINES["bad-cron"] in lines
    assert lines[-1] == (
        "Dry run, nothing changed: 6 would be imported, 1 exist(s), 5 refused (periodic tasks in database 'default')."
    )
    assert list(Schedule.objects.values_list("name", flat=True)) == ["existing"]


def test_import_celery_beat__json_reports_each_task_and_the_counts(periodic_tasks: None) -> None:
    # When the import prints JSON
    report = json.loads(run("--json"))

    # Then it holds the counts, every outcome with its reason or notes, and the fields each schedule got
    assert (report["database"], report["dry_run"]) == ("default", False)
    assert report["counts"] == {"imported": 6, "exists": 1, "refused": 5}
    tasks = {task["name"]: task for task in report["tasks"]}
    assert tasks["sunrise"]["outcome"] == "refused"
    assert tasks["sunrise"]["reason"].startswith("solar schedules (sunrise at ")
    assert tasks["existing"] == {"name": "existing", "outcome": "exists", "reason": "", "notes": [], "schedule": None}
    poll_once = Schedule.objects.get(name="poll-once")
    assert (poll_once.exchange, poll_once.routing_key, poll_once.headers) == ("legacy", "legacy.poll", {"trace": "on"})
    assert Schedule.objects.get(name="expiring-messages").expires == 60
    assert tasks["nightly-report"]["schedule"] == {
        "name": "nightly-report",
        "task": "scheduler.echo",
        "args": [1, "two"],
        "kwargs": {"fmt": "pdf"},
        "queue": "reports",
        "priority": 5,
        "expires": None,
        "headers": {},
        "exchange": "",
        "routing_key": "",
        "description": "The nightly PDF.",
        "enabled": True,
        "start_at": "2030-05-01T00:00:00Z",
        "end_at": "2030-12-31T00:00:00Z",
        "cron": "0 3 * * 1-5",
        "timezone": "Europe/Berlin",
    }
    assert Schedule.objects.count() == 7
    assert Schedule.objects.get(name="nightly-report").origin == Schedule.Origin.IMPORT


def test_import_celery_beat__without_its_tables_is_one_line_error() -> None:
    # Given a database without django-celery-beat's tables (dropped inside the test's transaction)
    with connection.cursor() as cursor:
        for table in ("periodictask", "crontabschedule", "intervalschedule", "clockedschedule", "solarschedule"):
            cursor.execute(f"DROP TABLE {connection.ops.quote_name('django_celery_beat_' + table)}")

    # When / Then the import refuses in one line and creates nothing
    assert refused() == "no django-celery-beat tables in database 'default'"
    assert not Schedule.objects.exists()


def test_import_celery_beat__unknown_database_alias_is_one_line_error() -> None:
    assert refused("--database", "old") == "no database alias 'old' in DATABASES"

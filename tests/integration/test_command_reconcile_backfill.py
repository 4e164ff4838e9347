"""``reconcile`` and ``backfill`` commands: output, ``--json``, ``--dry-run``, and bad input that changes nothing."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis

from scheduler import dbclock
from scheduler.models import Execution, Instance, Schedule
from scheduler.owners import schedules
from tests.integration.command_support import refused, run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def lost_counts_against_max_retries(settings: Any) -> None:
    """These tests pin ``max_retries`` for lost attempts: no extra lost-worker re-runs."""
    settings.SCHEDULER_LOST_RETRIES = 0


Status = Execution.Status
HOUR = timedelta(hours=1)


def lost_execution_and_stale_instance() -> Execution:
    now = dbclock.now()
    lost = Execution.objects.create(
        idempotency_key="lost",
        task="scheduler.echo",
        scheduled_for=now - HOUR,
        status=Status.RUNNING,
        started_at=now - HOUR,
        claim_expires_at=now - timedelta(seconds=1),
    )
    Instance.objects.create(
        instance_id="gone-1", role="worker", hostname="h", pid=1, started_at=now, last_seen=now - timedelta(days=1)
    )
    return lost


# --- reconcile -------------------------------------------------------------------------


def test_reconcile__prints_one_line_per_change_and_a_summary() -> None:
    lost = lost_execution_and_stale_instance()

    lines = run("reconcile").splitlines()

    assert lines[0] == f"lost_failed      execution {lost.pk}: Worker lost during attempt 1; no retries left"
    assert lines[1].startswith("instance_removed worker gone-1, last seen ")
    assert lines[2] == "reconcile: 1 lost execution(s) failed, 1 stale instance(s) removed"
    assert Execution.objects.get(pk=lost.pk).status == Status.FAILED
    assert run("reconcile") == "reconcile: nothing to reconcile\n"


def test_reconcile__json_prints_the_report() -> None:
    lost = lost_execution_and_stale_instance()

    report = json.loads(run("reconcile", "--json"))

    assert report["counts"] == {"lost_failed": 1, "instance_removed": 1}
    assert report["changes"][0] == {
        "kind": "lost_failed",
        "execution_id": lost.pk,
        "schedule_id": None,
        "detail": "Worker lost during attempt 1; no retries left",
    }
    assert (report["dry_run"], report["repair"], report["publish_error"]) == (False, False, "")


def test_reconcile__dry_run_changes_nothing() -> None:
    lost = lost_execution_and_stale_instance()

    output = run("reconcile", "--dry-run", "--repair")

    assert (
        output.splitlines()[-1] == "dry run, nothing changed: 1 lost execution(s) failed, 1 stale instance(s) removed"
    )
    assert Execution.objects.get(pk=lost.pk).status == Status.RUNNING
    assert Instance.objects.count() == 1


def test_reconcile__unknown_option_refused() -> None:
    assert refused("reconcile", "--repiar").startswith("Error: unrecognized arguments: --repiar")


# --- backfill --------------------------------------------------------------------------


@pytest.fixture
def hourly() -> Schedule:
    """An hourly schedule in Europe/Berlin."""
    schedule = Schedule(name="hourly", task="scheduler.echo", interval=3600, timezone="Europe/Berlin")
    schedule.full_clean()
    schedules.save(schedule)
    return schedule


def last_hour() -> datetime:
    return dbclock.now().replace(minute=0, second=0, microsecond=0)


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def test_backfill__records_sends_and_a_second_run_creates_nothing(hourly: Schedule, redis_client: redis.Redis) -> None:
    end = last_hour()
    start = end - 4 * HOUR

    first = run("backfill", "hourly", "--start", iso(start), "--end", iso(end))
    second = json.loads(run("backfill", "hourly", "--start", iso(start), "--end", iso(end), "--json"))

    assert first == (
        f"5 slot(s) of hourly from {start.isoformat()} to {end.isoformat()}: "
        "5 recorded, 5 sent, 0 already had an execution\n"
    )
    assert (second["created"], second["already_present"], second["published"]) == (0, 5, 0)
    assert Execution.objects.filter(schedule=hourly, status=Status.QUEUED).count() == 5
    assert redis_client.llen("celery") == 5


def test_backfill__dry_run_lists_local_and_utc_times_and_writes_nothing(hourly: Schedule) -> None:
    end = last_hour()

    lines = run("backfill", "hourly", "--start", iso(end - HOUR), "--end", iso(end), "--dry-run").splitlines()

    local = end.astimezone(ZoneInfo("Europe/Berlin"))
    assert lines[1] == f"{local:%Y-%m-%d %H:%M:%S %Z}  {end.isoformat()}  missing, would be recorded"
    assert lines[-1].startswith("dry run, nothing changed: 2 slot(s) of hourly")
    assert lines[-1].endswith("2 would be recorded, 0 already have one")
    assert not Execution.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope", "--start", "2020-01-01", "--end", "2020-01-02"], "No schedule named 'nope'"),
        (["hourly", "--start", "yesterday", "--end", "2020-01-02"], "--start 'yesterday' is not an ISO-8601 date"),
        (["hourly", "--start", "2020-01-02", "--end", "2020-01-01"], "must be after start"),
        (["hourly", "--start", "2020-01-01", "--end", "2999-01-01"], "only past slots can be backfilled"),
        (["hourly", "--start", "2020-01-01", "--end", "2020-01-02", "--limit", "-1"], "-1 is negative"),
        (["hourly", "--start", "2020-01-01", "--end", "2020-01-02", "--rate", "0"], "0 must be greater than 0"),
        (["hourly", "--start", "2020-01-01", "--end", "2020-01-02", "--limit", "10"], "the range holds 25 slots"),
    ],
    ids=[
        "unknown-schedule",
        "bad-iso",
        "end-before-start",
        "end-in-future",
        "negative-limit",
        "zero-rate",
        "over-limit",
    ],
)
def test_backfill__bad_input_refused_in_one_line_and_nothing_changed(
    hourly: Schedule, args: list[str], message: str
) -> None:
    assert message in refused("backfill", *args)
    assert not Execution.objects.exists()

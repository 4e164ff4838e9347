"""``manage.py schedules``: every action, and bad input refused in one line with nothing changed."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from typing import Any

import pytest
import redis
import time_machine
from django.core.management import call_command

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler.models import Execution, Schedule
from tests.integration import command_support
from tests.integration.command_support import run
from tests.support.factories import make_schedule
from tests.support.services import free_port

pytestmark = pytest.mark.django_db

Status = Execution.Status


schedules = partial(run, "schedules")
refused = partial(command_support.refused, "schedules")


def database() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every schedule and execution row, to prove that nothing changed."""
    return list(Schedule.objects.order_by("pk").values()), list(Execution.objects.order_by("pk").values())


# --- create --------------------------------------------------------------------------


def test_create__cron_schedule_is_saved_with_its_next_run() -> None:
    # When
    out = schedules(
        "create", "nightly", "--task", "scheduler.echo", "--cron", "0 2 * * *", "--timezone", "Europe/Berlin"
    )
    # Then
    schedule = Schedule.objects.get(name="nightly")
    assert (schedule.task, schedule.cron, schedule.timezone, schedule.enabled) == (
        "scheduler.echo",
        "0 2 * * *",
        "Europe/Berlin",
        True,
    )
    assert schedule.next_run_at is not None
    assert out.startswith("Created schedule 'nightly': cron 0 2 * * * (Europe/Berlin), enabled, next run ")


def test_create__every_option_sets_its_field() -> None:
    # When
    out = schedules(
        "create",
        "poll",
        "--task",
        "tests.record",
        "--every",
        "30",
        "--args",
        '["a", 2]',
        "--kwargs",
        '{"k": 1}',
        "--queue",
        "reports",
        "--timeout",
        "60",
        "--overlap",
        "skip",
        "--misfire",
        "run_once",
        "--catchup-window",
        "120",
        "--max-retries",
        "3",
        "--start",
        "2026-01-01T00:00:00Z",
        "--end",
        "2027-01-01T00:00:00+01:00",
        "--max-runs",
        "9",
        "--disabled",
        "--json",
    )
    # Then
    schedule = Schedule.objects.get(name="poll")
    assert (schedule.interval, schedule.args, schedule.kwargs, schedule.queue) == (30, ["a", 2], {"k": 1}, "reports")
    assert (schedule.timeout, schedule.overlap, schedule.misfire) == (60, "skip", "run_once")
    assert (schedule.catchup_window, schedule.max_retries, schedule.max_runs) == (120, 3, 9)
    assert schedule.start_at == datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert schedule.end_at == datetime(2026, 12, 31, 23, tzinfo=timezone.utc)
    assert (schedule.enabled, schedule.next_run_at) == (False, None)
    printed = json.loads(out)
    assert printed["dry_run"] is False
    assert printed["schedule"]["id"] == schedule.pk and printed["schedule"]["args"] == ["a", 2]


def test_create__one_off_at_an_iso_time() -> None:
    schedules("create", "once", "--task", "scheduler.echo", "--at", "2030-05-01T08:00:00Z")
    schedule = Schedule.objects.get(name="once")
    assert schedule.run_at == schedule.next_run_at == datetime(2030, 5, 1, 8, tzinfo=timezone.utc)


def test_create__dry_run_saves_nothing() -> None:
    out = schedules("create", "nightly", "--task", "scheduler.echo", "--cron", "0 2 * * *", "--dry-run")
    assert out.startswith("Would create schedule 'nightly': cron 0 2 * * * (UTC), enabled, next run 20")
    assert not Schedule.objects.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--cron", "61 * * * *"], "cron: "),
        (["--cron", "* * *"], "cron: Cron expression must have 5 or 6 fields, got 3"),
        (["--every", "0"], "interval: Ensure this value is greater than or equal to 1."),
        (["--every", "5", "--args", "[1,"], "--args is not valid JSON"),
        (["--every", "5", "--args", '{"a": 1}'], "--args must be a JSON list"),
        (["--every", "5", "--kwargs", "[1]"], "--kwargs must be a JSON object"),
        (["--at", "next tuesday"], "--at 'next tuesday' is not an ISO-8601 date or time"),
        (["--every", "5", "--timezone", "Mars/Olympus"], "timezone: Unknown timezone 'Mars/Olympus'"),
        (["--every", "5", "--start", "2026-02-01", "--end", "2026-01-01"], "end_at: End must be after start."),
        (["--every", "5", "--timeout", "-1"], "timeout: Ensure this value is greater than or equal to 1."),
        (["--every", "5", "--catchup-window", "-1"], "catchup_window: Ensure this value is greater than or equal to 0"),
    ],
)
def test_create__bad_input_is_refused_and_nothing_is_saved(options: list[str], message: str) -> None:
    # Given an existing schedule
    make_schedule("existing")
    before = database()
    # When / Then
    assert message in refused("create", "new", "--task", "scheduler.echo", *options)
    assert database() == before


def test_create__unknown_task_is_refused() -> None:
    message = refused("create", "new", "--task", "no.such.task", "--every", "5")
    assert message == "task: Unknown task 'no.such.task': no task with that name is registered."
    assert not Schedule.objects.exists()


def test_create__every_problem_is_reported_on_one_line() -> None:
    message = refused("create", "new", "--task", "no.such", "--cron", "* *", "--timezone", "Nowhere/Atlantis")
    assert {part.split(":")[0] for part in message.split("; ")} == {"cron", "timezone", "task"}


def test_create__duplicate_name_is_refused() -> None:
    make_schedule("nightly", interval=60)
    before = database()
    assert refused("create", "nightly", "--task", "scheduler.echo", "--every", "5") == (
        "name: Schedule with this Name already exists."
    )
    assert database() == before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ([], "one of the arguments --cron --every --at --run-now is required"),
        (["--cron", "* * * * *", "--every", "5"], "not allowed with argument"),
        (["--every", "often"], "argument --every: invalid int value: 'often'"),
        (["--every", "5", "--overlap", "sometimes"], "argument --overlap: invalid choice: 'sometimes'"),
    ],
)
def test_create__malformed_arguments_are_refused(options: list[str], message: str) -> None:
    assert message in refused("create", "new", "--task", "scheduler.echo", *options)
    assert not Schedule.objects.exists()


# --- list, show, next --------------------------------------------------------------------


def test_list__one_line_per_schedule_with_timing_and_state() -> None:
    # Given
    make_schedule("a-cron", cron="*/5 * * * *", timezone="Europe/Berlin")
    make_schedule("b-every", interval=30, paused_reason="vendor outage")
    make_schedule("c-off", interval=30, enabled=False)
    # When
    lines = schedules("list").splitlines()
    # Then
    assert lines[0].split() == [
        "NAME",
        "TASK",
        "TIMING",
        "TIMEZONE",
        "STATE",
        "NEXT",
        "RUN",
        "LAST",
        "SUCCESS",
        "OVERDUE",
    ]
    assert lines[1].split()[:8] == ["a-cron", "scheduler.echo", "cron", "*/5", "*", "*", "*", "*"]
    assert "Europe/Berlin  enabled" in lines[1]
    assert "every 30s" in lines[2] and "paused (vendor outage)" in lines[2] and lines[2].endswith("-")
    assert "disabled" in lines[3]


def test_list__json() -> None:
    make_schedule("nightly", cron="0 2 * * *")
    [row] = json.loads(schedules("list", "--json"))
    assert row["name"] == "nightly" and row["timing"] == "cron 0 2 * * *" and row["enabled"] is True
    assert row["next_run_at"] is not None


def test_list__empty() -> None:
    assert schedules("list") == "No schedules.\n"


def test_show__every_field() -> None:
    schedule = make_schedule("nightly", cron="0 2 * * *", kwargs={"a": 1})
    data = json.loads(schedules("show", "nightly", "--json"))
    assert data["id"] == schedule.pk and data["kwargs"] == {"a": 1} and data["cron"] == "0 2 * * *"
    assert {"overlap", "misfire", "catchup_window", "next_run_at", "total_runs", "paused_reason"} <= data.keys()
    text = schedules("show", "nightly")
    assert 'kwargs                 {"a": 1}' in text and "timing                 cron 0 2 * * *" in text


@pytest.mark.parametrize(
    "action", ["show", "update", "enable", "disable", "pause", "resume", "delete", "run-now", "next"]
)
def test_unknown_schedule__is_refused_in_one_line(action: str) -> None:
    make_schedule("nightly")
    before = database()
    extra = ["--queue", "q"] if action == "update" else []
    assert refused(action, "nightly-typo", *extra) == "No schedule named 'nightly-typo'"
    assert database() == before


def test_next__fire_times_in_the_zone_and_in_utc_across_spring_forward() -> None:
    # Given a Berlin schedule at 02:30, a local time that does not exist on 2026-03-29
    make_schedule("early", cron="30 2 * * *", timezone="Europe/Berlin")
    # When
    with time_machine.travel(datetime(2026, 3, 27, 12, tzinfo=timezone.utc), tick=False):
        out = schedules("next", "early", "-n", "3")
    # Then the gap day runs at 03:00 CEST (dst_gap=shift)
    assert out.splitlines() == [
        "Sat 2026-03-28 02:30:00 CET  (2026-03-28 01:30:00 UTC)",
        "Sun 2026-03-29 03:00:00 CEST  (2026-03-29 01:00:00 UTC)",
        "Mon 2026-03-30 02:30:00 CEST  (2026-03-30 00:30:00 UTC)",
    ]


def test_next__json_and_a_note_when_the_schedule_does_not_fire() -> None:
    make_schedule("paused", interval=60, paused_reason="maintenance")
    with time_machine.travel(datetime(2026, 3, 27, 12, tzinfo=timezone.utc), tick=False):
        data = json.loads(schedules("next", "paused", "--json", "-n", "2"))
        text = schedules("next", "paused")
    assert [row["utc"] for row in data] == ["2026-03-27T12:01:00Z", "2026-03-27T12:02:00Z"]
    assert text.splitlines()[-1] == "Note: the schedule is paused (maintenance); it does not fire until turned on."


@pytest.mark.parametrize("count", ["0", "-3", "1001", "many"])
def test_next__count_out_of_range_is_refused(count: str) -> None:
    make_schedule("nightly")
    assert "argument -n/--count" in refused("next", "nightly", "-n", count)


# --- update ----------------------------------------------------------------------------


def test_update__only_the_given_fields_change() -> None:
    # Given
    schedule = make_schedule("nightly", cron="0 2 * * *", queue="default", timeout=30, args=[1])
    # When
    schedules("update", "nightly", "--queue", "reports", "--args", "[2, 3]")
    # Then
    schedule.refresh_from_db()
    assert (schedule.queue, schedule.args, schedule.cron, schedule.timeout) == ("reports", [2, 3], "0 2 * * *", 30)


def test_update__a_new_timing_replaces_the_old_one() -> None:
    schedule = make_schedule("nightly", cron="0 2 * * *")
    out = schedules("update", "nightly", "--every", "900")
    schedule.refresh_from_db()
    assert (schedule.cron, schedule.interval, schedule.run_at) == ("", 900, None)
    assert schedule.next_run_at is not None and schedule.next_run_at.timestamp() % 900 == 0
    assert out.startswith("Updated schedule 'nightly': every 900s (UTC), enabled, next run ")


def test_update__dry_run_changes_nothing() -> None:
    make_schedule("nightly", cron="0 2 * * *")
    before = database()
    out = schedules("update", "nightly", "--every", "900", "--dry-run")
    assert out.startswith("Would update schedule 'nightly': every 900s (UTC)")
    assert database() == before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--cron", "0 25 * * *"], "cron: "),
        (["--timezone", "Europe/Atlantis"], "timezone: Unknown timezone 'Europe/Atlantis'"),
        (["--kwargs", "{oops}"], "--kwargs is not valid JSON"),
        (["--end", "2020-01-01T00:00:00Z", "--start", "2021-01-01T00:00:00Z"], "end_at: End must be after start."),
        (["--start", "2026-13-01"], "--start '2026-13-01' is not an ISO-8601 date or time"),
        (["--task", "no.such.task"], "task: Unknown task 'no.such.task'"),
        ([], "Nothing to change"),
    ],
)
def test_update__bad_input_is_refused_and_the_row_is_unchanged(options: list[str], message: str) -> None:
    make_schedule("nightly", cron="0 2 * * *")
    before = database()
    assert message in refused("update", "nightly", *options)
    assert database() == before


# --- enable, disable, pause, resume, delete ------------------------------------------------------


def test_disable_then_enable() -> None:
    schedule = make_schedule("nightly", interval=60)
    assert schedules("disable", "nightly").startswith("Disabled schedule 'nightly': every 60s (UTC), disabled,")
    schedule.refresh_from_db()
    assert (schedule.enabled, schedule.next_run_at) == (False, None)
    schedules("enable", "nightly")
    schedule.refresh_from_db()
    assert schedule.enabled and schedule.next_run_at is not None


def test_enable__clears_the_reason_it_turned_itself_off() -> None:
    schedule = make_schedule("nightly", interval=60)
    Schedule.objects.filter(pk=schedule.pk).update(enabled=False, disabled_reason="Used all 3 runs (max_runs)")
    schedules("enable", "nightly")
    schedule.refresh_from_db()
    assert (schedule.enabled, schedule.disabled_reason) == (True, "")


def test_pause_with_a_reason_then_resume() -> None:
    # Given a schedule whose circuit breaker counted failures
    schedule = make_schedule("nightly", interval=60)
    Schedule.objects.filter(pk=schedule.pk).update(consecutive_failures=4)
    # When paused
    out = schedules("pause", "nightly", "--reason", "vendor outage")
    # Then
    schedule.refresh_from_db()
    assert (schedule.paused_reason, schedule.next_run_at) == ("vendor outage", None)
    assert "paused (vendor outage)" in out
    # When resumed
    schedules("resume", "nightly")
    # Then it fires again and the failure count is reset
    schedule.refresh_from_db()
    assert (schedule.paused_reason, schedule.consecutive_failures) == ("", 0)
    assert schedule.next_run_at is not None


def test_pause__without_a_reason() -> None:
    schedules("pause", make_schedule("nightly").name)
    assert Schedule.objects.get(name="nightly").paused_reason == "Paused"


@pytest.mark.parametrize("action", ["disable", "pause", "delete"])
def test_state_changes__dry_run_changes_nothing(action: str) -> None:
    make_schedule("nightly")
    before = database()
    assert schedules(action, "nightly", "--dry-run").startswith(f"Would {action} schedule 'nightly'")
    assert database() == before


def test_delete__executions_keep_their_history() -> None:
    # Given a schedule with an execution
    schedule = make_schedule("nightly")
    execution = Execution.objects.create(
        idempotency_key="k",
        schedule=schedule,
        task=schedule.task,
        scheduled_for=datetime.now(timezone.utc),
        status=Status.SUCCEEDED,
    )
    # When
    out = schedules("delete", "nightly")
    # Then
    assert out == "Deleted schedule 'nightly'; its 1 execution(s) keep their history.\n"
    assert not Schedule.objects.exists()
    execution.refresh_from_db()
    assert (execution.schedule_id, execution.status) == (None, Status.SUCCEEDED)


# --- run-now ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_run_now__records_an_execution_and_sends_it(redis_client: redis.Redis) -> None:
    # Given
    schedule = make_schedule(
        "nightly",
        task="tests.record",
        args=["x"],
        kwargs={"seconds": 0},
        queue="reports",
        timeout=30,
        max_retries=2,
        retry_backoff=5,
        tenant="acme",
    )
    # When
    out = schedules("run-now", "nightly")
    # Then one execution, queued, with the schedule's settings and its own key
    execution = Execution.objects.get()
    assert execution.status == Status.QUEUED and execution.enqueued_at is not None
    assert execution.idempotency_key.startswith(f"schedule:{schedule.pk}:manual:")
    assert (execution.schedule_id, execution.task, execution.args, execution.kwargs) == (
        schedule.pk,
        "tests.record",
        ["x"],
        {"seconds": 0},
    )
    assert (execution.queue, execution.timeout, execution.max_retries, execution.retry_backoff, execution.tenant) == (
        "reports",
        30,
        2,
        5,
        "acme",
    )
    assert execution.celery_task_id and execution.attempt == 1
    assert out == f"Execution {execution.pk} of schedule 'nightly': queued (celery id {execution.celery_task_id}).\n"
    # and the message is on its queue
    assert redis_client.llen("reports") == 1


@pytest.mark.django_db(transaction=True)
def test_run_now__twice_makes_two_executions(redis_client: redis.Redis) -> None:
    make_schedule("nightly")
    first = json.loads(schedules("run-now", "nightly", "--json"))
    second = json.loads(schedules("run-now", "nightly", "--json"))
    assert first["execution"]["id"] != second["execution"]["id"]
    assert first["broker_error"] == second["broker_error"] == ""
    assert list(Execution.objects.values_list("status", flat=True)) == [Status.QUEUED, Status.QUEUED]
    assert redis_client.llen("celery") == 2


def test_run_now__dry_run_records_nothing() -> None:
    make_schedule("nightly")
    assert schedules("run-now", "nightly", "--dry-run") == "Would run schedule 'nightly' now (task scheduler.echo).\n"
    assert not Execution.objects.exists()


def test_run_now__a_task_that_is_no_longer_registered_is_refused() -> None:
    # Given a schedule whose task was removed from the code
    schedule = make_schedule("nightly")
    Schedule.objects.filter(pk=schedule.pk).update(task="removed.task")
    # When / Then
    assert refused("run-now", "nightly") == "Unknown task 'removed.task': no task with that name is registered."
    assert not Execution.objects.exists()


# --- as a real process -----------------------------------------------------------------------


def test_process__create_and_list(manage: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    created = manage("schedules", "create", "nightly", "--task", "scheduler.echo", "--cron", "0 2 * * *")
    assert (created.returncode, created.stderr) == (0, "")
    assert Schedule.objects.get(name="nightly").cron == "0 2 * * *"
    listed = manage("schedules", "list")
    assert listed.returncode == 0 and "nightly" in listed.stdout


@pytest.mark.parametrize(
    ("argv", "returncode", "message"),
    [
        (["create", "x", "--task", "scheduler.echo", "--cron", "not a cron"], 1, "CommandError: cron: "),
        (["create", "x", "--task", "scheduler.echo", "--every", "5", "--args", "{"], 1, "--args is not valid JSON"),
        (["create", "x", "--task", "scheduler.echo", "--at", "soon"], 1, "is not an ISO-8601 date or time"),
        (["create", "x", "--task", "scheduler.echo", "--every", "5", "--timezone", "Moon/Base"], 1, "Unknown timezone"),
        (["show", "missing"], 1, "CommandError: No schedule named 'missing'"),
        (
            ["create", "x", "--task", "scheduler.echo"],
            2,
            "one of the arguments --cron --every --at --run-now is required",
        ),
        (["next", "x", "-n", "-1"], 2, "argument -n/--count"),
        (["explode"], 2, "invalid choice: 'explode'"),
    ],
)
def test_process__bad_input_exits_non_zero_with_one_line(
    manage: Callable[..., subprocess.CompletedProcess[str]], argv: list[str], returncode: int, message: str
) -> None:
    # When
    result = manage("schedules", *argv)
    # Then
    assert result.returncode == returncode
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr
    assert not Schedule.objects.exists()


def test_process__run_now_while_the_broker_is_down_leaves_the_execution_pending(
    manage: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    # Given a schedule and no broker at the configured address
    make_schedule("nightly")
    # When
    result = manage("schedules", "run-now", "nightly", broker=f"redis://127.0.0.1:{free_port()}/0")
    # Then the execution is recorded, pending, for the beat leader to send
    assert result.returncode == 0, result.stderr
    execution = Execution.objects.get()
    assert execution.status == Status.PENDING and execution.celery_task_id
    assert "still pending: the broker is unreachable" in result.stdout
    assert "Traceback" not in result.stderr


def test_names_per_tenant__a_name_two_tenants_use_is_named_by_id(tenant_twins: tuple[Schedule, Schedule]) -> None:
    # Given: acme and globex both have a schedule named "nightly"
    acme, globex = tenant_twins
    # When: the command line names it
    message = refused("show", "nightly")
    # Then: it refuses to guess and lists the ids, and either id works
    assert (
        message
        == f"2 schedules are named 'nightly': give one's id instead: {acme.pk} (tenant acme), {globex.pk} (tenant globex)"
    )
    out = io.StringIO()
    call_command("schedules", "show", str(globex.pk), "--json", stdout=out)
    assert json.loads(out.getvalue())["tenant"] == "globex"


@pytest.fixture
def tenant_twins() -> tuple[Schedule, Schedule]:
    return make_schedule("nightly", tenant="acme"), make_schedule("nightly", tenant="globex")

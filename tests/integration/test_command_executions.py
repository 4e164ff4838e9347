"""``manage.py executions``: list, show, retry and cancel, and bad input refused in one line with nothing changed."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from functools import partial
from itertools import count
from typing import Any

import pytest
import redis

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from project.celery import app
from scheduler.models import Execution, Schedule
from scheduler.ops import audit, operations
from scheduler.owners import schedules
from tests.integration import command_support
from tests.integration.command_support import run
from tests.support.factories import make_execution, make_schedule
from tests.support.services import free_port

pytestmark = pytest.mark.django_db

Status = Execution.Status
T0 = datetime(2026, 3, 1, 12, tzinfo=timezone.utc)
_keys = count()


executions = partial(run, "executions")
refused = partial(command_support.refused, "executions")


def database() -> list[dict[str, Any]]:
    """Every execution row, to prove that nothing changed."""
    return list(Execution.objects.order_by("pk").values())


def make(status: str = Status.SUCCEEDED, *, minutes: int = 0, **fields: Any) -> Execution:
    """An execution scheduled ``minutes`` after T0."""
    return make_execution(
        f"test:{next(_keys)}",
        status=status,
        scheduled_for=T0 + timedelta(minutes=minutes),
        celery_task_id=f"celery-{next(_keys)}",
        **fields,
    )


@pytest.fixture
def nightly() -> Schedule:
    return make_schedule("nightly")


# --- list ------------------------------------------------------------------------------


def test_list__newest_first_with_status_and_schedule(nightly: Schedule) -> None:
    # Given
    old = make(Status.SUCCEEDED, minutes=0, schedule=nightly)
    new = make(Status.FAILED, minutes=5)
    # When
    lines = executions("list").splitlines()
    # Then
    assert lines[0].split() == ["ID", "STATUS", "TRIGGER", "SCHEDULED", "FOR", "TASK", "SCHEDULE", "ATTEMPT"]
    assert lines[1].split() == [
        str(new.pk),
        "failed",
        "scheduled",
        "2026-03-01T12:05:00+00:00",
        "scheduler.echo",
        "-",
        "1",
    ]
    assert lines[2].split() == [
        str(old.pk),
        "succeeded",
        "scheduled",
        "2026-03-01T12:00:00+00:00",
        "scheduler.echo",
        "nightly",
        "1",
    ]


def test_list__at_most_50_by_default() -> None:
    Execution.objects.bulk_create(
        Execution(idempotency_key=f"bulk:{i}", task="scheduler.echo", scheduled_for=T0 + timedelta(seconds=i))
        for i in range(60)
    )
    rows = json.loads(executions("list", "--json"))
    assert len(rows) == 50
    assert rows[0]["scheduled_for"] == "2026-03-01T12:00:59Z"
    assert len(json.loads(executions("list", "--json", "--limit", "0"))) == 60


def test_list__filters(nightly: Schedule) -> None:
    # Given
    make(Status.FAILED, minutes=0, schedule=nightly)
    wanted = make(Status.FAILED, minutes=10, schedule=nightly)
    make(Status.SUCCEEDED, minutes=20, schedule=nightly)
    make(Status.FAILED, minutes=30)
    latest_failed = make(Status.FAILED, minutes=40, schedule=nightly)
    # When
    rows = json.loads(
        executions("list", "--json", "--status", "failed", "--schedule", "nightly", "--since", "2026-03-01T12:05:00Z")
    )
    limited = json.loads(executions("list", "--json", "--status", "failed", "--limit", "1"))
    # Then
    assert [row["id"] for row in rows] == [latest_failed.pk, wanted.pk]
    assert rows[0]["schedule"] == "nightly" and rows[0]["status"] == "failed"
    assert [row["id"] for row in limited] == [latest_failed.pk]


def test_list__empty() -> None:
    assert executions("list") == "No executions.\n"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--status", "exploded"], "argument --status: invalid choice: 'exploded'"),
        (["--limit", "-1"], "argument --limit: -1 is negative; expected 0 or more"),
        (["--limit", "ten"], "argument --limit: 'ten' is not a whole number"),
        (["--since", "last week"], "--since 'last week' is not an ISO-8601 date or time"),
        (["--schedule", "nope"], "No schedule named 'nope'"),
    ],
)
def test_list__bad_input_is_refused(options: list[str], message: str) -> None:
    make()
    assert message in refused("list", *options)


# --- show --------------------------------------------------------------------------------


def test_show__every_field(nightly: Schedule) -> None:
    execution = make(Status.FAILED, schedule=nightly, error="boom", args=[1])
    data = json.loads(executions("show", str(execution.pk), "--json"))
    assert (data["id"], data["status"], data["error"], data["args"]) == (execution.pk, "failed", "boom", [1])
    assert data["schedule_id"] == nightly.pk and data["retry_of_id"] is None
    text = executions("show", str(execution.pk))
    assert "error              boom" in text and "schedule name      nightly" in text


def test_list_and_show__the_trigger(nightly: Schedule) -> None:
    # Given a slot the beat fired and an operator's run-now
    make(schedule=nightly, minutes=1)
    manual = make(schedule=nightly, minutes=2, trigger=Execution.Trigger.MANUAL)
    # When / Then
    listed = json.loads(executions("list", "--json"))
    assert [row["trigger"] for row in listed] == ["manual", "scheduled"]
    assert [row["id"] for row in json.loads(executions("list", "--trigger", "manual", "--json"))] == [manual.pk]
    assert "TRIGGER" in executions("list").splitlines()[0]
    assert json.loads(executions("show", str(manual.pk), "--json"))["trigger"] == "manual"
    assert "trigger            manual" in executions("show", str(manual.pk))


@pytest.mark.parametrize("action", ["show", "retry", "cancel"])
def test_unknown_execution__is_refused_in_one_line(action: str) -> None:
    make()
    before = database()
    assert refused(action, "999999") == "No execution with id 999999"
    assert "argument ID: 'seven' is not a whole number" in refused(action, "seven")
    assert database() == before


# --- retry ----------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("status", [Status.FAILED, Status.TIMED_OUT, Status.CANCELLED, Status.SUCCEEDED, Status.LOST])
def test_retry__a_finished_execution_runs_again_as_a_new_one(redis_client: redis.Redis, status: str) -> None:
    # Given a finished execution of a schedule, on its third attempt
    schedule = schedules.create(name="nightly", task="tests.record", interval=60)
    original = make(
        status,
        schedule=schedule,
        task="tests.record",
        args=["x"],
        kwargs={"seconds": 0},
        queue="reports",
        timeout=30,
        max_retries=2,
        retry_backoff=5,
        tenant="acme",
        attempt=3,
        error="boom",
    )
    before = Execution.objects.filter(pk=original.pk).values().get()
    # When
    out = executions("retry", str(original.pk))
    # Then a new execution, linked to the original, was sent
    retry = Execution.objects.exclude(pk=original.pk).get()
    assert retry.retry_of_id == original.pk
    assert retry.idempotency_key.startswith(f"retry:{original.pk}:")
    assert (retry.status, retry.attempt, retry.error) == (Status.QUEUED, 1, "")
    assert retry.celery_task_id and retry.celery_task_id != original.celery_task_id
    assert (retry.schedule_id, retry.task, retry.args, retry.kwargs, retry.queue) == (
        schedule.pk,
        "tests.record",
        ["x"],
        {"seconds": 0},
        "reports",
    )
    assert (retry.timeout, retry.max_retries, retry.retry_backoff, retry.tenant) == (30, 2, 5, "acme")
    assert retry.scheduled_for > original.scheduled_for
    assert out == f"Execution {retry.pk} retries execution {original.pk}: queued (celery id {retry.celery_task_id}).\n"
    assert redis_client.llen("reports") == 1
    # and the original is untouched
    assert Execution.objects.filter(pk=original.pk).values().get() == before


@pytest.mark.parametrize("status", [Status.PENDING, Status.QUEUED, Status.RUNNING, Status.RETRYING])
def test_retry__an_unfinished_execution_is_refused(status: str) -> None:
    execution = make(status)
    before = database()
    assert refused("retry", str(execution.pk)) == (
        f"Execution {execution.pk} is {status}; only finished or lost executions can be retried."
    )
    assert database() == before


def test_retry__dry_run_records_nothing() -> None:
    execution = make(Status.FAILED)
    before = database()
    out = executions("retry", str(execution.pk), "--dry-run")
    assert out == f"Would retry execution {execution.pk} (scheduler.echo, failed) as a new execution.\n"
    assert database() == before


def test_retry__a_task_that_is_no_longer_registered_is_refused() -> None:
    execution = make(Status.FAILED, task="removed.task")
    before = database()
    assert refused("retry", str(execution.pk)) == "Unknown task 'removed.task': no task with that name is registered."
    assert database() == before


# --- cancel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.PENDING, Status.QUEUED, Status.RUNNING, Status.RETRYING])
def test_cancel__an_unfinished_execution_is_recorded_cancelled(status: str) -> None:
    # Given
    execution = make(status, buffered=status == Status.PENDING)
    Execution.objects.filter(pk=execution.pk).update(claim_expires_at=T0)
    # When
    out = executions("cancel", str(execution.pk))
    # Then
    execution.refresh_from_db()
    assert (execution.status, execution.error, execution.claim_expires_at, execution.buffered) == (
        Status.CANCELLED,
        "Cancelled by an operator",
        None,
        False,
    )
    assert execution.finished_at is not None
    assert out == f"Cancelled execution {execution.pk} (was {status}).\n"


@pytest.mark.parametrize(
    "status",
    [Status.SUCCEEDED, Status.FAILED, Status.TIMED_OUT, Status.CANCELLED, Status.SKIPPED, Status.MISSED, Status.LOST],
)
def test_cancel__a_finished_execution_is_refused(status: str) -> None:
    execution = make(status)
    before = database()
    assert refused("cancel", str(execution.pk)) == (
        f"Execution {execution.pk} is {status}; only pending, queued, running or retrying executions can be cancelled."
    )
    assert database() == before


def test_cancel__dry_run_changes_nothing() -> None:
    execution = make(Status.RUNNING)
    before = database()
    assert executions("cancel", str(execution.pk), "--dry-run") == (
        f"Would cancel execution {execution.pk} (scheduler.echo, running).\n"
    )
    assert database() == before


def test_cancel__loses_cleanly_to_a_worker_that_finished_it_meanwhile() -> None:
    # Given an operator looking at a running execution
    execution = make(Status.RUNNING)
    seen = Execution.objects.get(pk=execution.pk)
    # and its worker recording success just before the cancel lands
    Execution.objects.filter(pk=execution.pk).update(status=Status.SUCCEEDED)
    # When
    with pytest.raises(operations.ActionRefused, match="became succeeded meanwhile; not cancelled"):
        operations.cancel_execution(seen, app=app, actor=audit.CLI)
    # Then the worker's outcome stands
    execution.refresh_from_db()
    assert (execution.status, execution.error) == (Status.SUCCEEDED, "")


@pytest.fixture
def pidbox(redis_client: redis.Redis) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Return a function listing the worker control commands broadcast so far."""
    listener = redis_client.pubsub()
    listener.psubscribe("*celery.pidbox")
    listener.get_message(timeout=1)  # the subscription confirmation

    def commands() -> list[dict[str, Any]]:
        received = []
        while (message := listener.get_message(timeout=1)) is not None:
            received.append(json.loads(base64.b64decode(json.loads(message["data"])["body"])))
        return received

    yield commands
    listener.close()


@pytest.mark.django_db(transaction=True)
def test_cancel__revokes_the_celery_task_after_commit(pidbox: Callable[[], list[dict[str, Any]]]) -> None:
    # Given
    execution = make(Status.RUNNING)
    # When
    data = json.loads(executions("cancel", str(execution.pk), "--json"))
    # Then the row is cancelled and workers were told to terminate its task
    assert (data["execution"]["status"], data["was"], data["broker_error"]) == ("cancelled", "running", "")
    [command] = pidbox()
    assert command["method"] == "revoke"
    assert command["arguments"]["task_id"] == execution.celery_task_id and command["arguments"]["terminate"] is True


# --- as a real process -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "returncode", "message"),
    [
        (["show", "123456"], 1, "CommandError: No execution with id 123456"),
        (["show", "abc"], 2, "argument ID: 'abc' is not a whole number"),
        (["list", "--status", "exploded"], 2, "argument --status: invalid choice: 'exploded'"),
        (["list", "--limit", "-5"], 2, "argument --limit: -5 is negative"),
        (["list", "--since", "2026-02-30"], 1, "--since '2026-02-30' is not an ISO-8601 date or time"),
        (["retry", "PENDING"], 1, "is pending; only finished or lost executions can be retried."),
        (["cancel", "SUCCEEDED"], 1, "is succeeded; only pending, queued, running or retrying executions"),
    ],
)
def test_process__bad_input_exits_non_zero_with_one_line(
    manage: Callable[..., subprocess.CompletedProcess[str]], argv: list[str], returncode: int, message: str
) -> None:
    # Given one execution per status the arguments name
    ids = {status.upper(): str(make(status).pk) for status in (Status.PENDING, Status.SUCCEEDED)}
    before = database()
    # When
    result = manage("executions", *[ids.get(arg, arg) for arg in argv])
    # Then
    assert result.returncode == returncode
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr
    assert database() == before


def test_process__cancel_while_the_broker_is_down_still_cancels(
    manage: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    # Given a running execution and no broker at the configured address
    execution = make(Status.RUNNING)
    # When
    result = manage("executions", "cancel", str(execution.pk), broker=f"redis://127.0.0.1:{free_port()}/0")
    # Then it is cancelled all the same, and the failed revoke is reported
    assert result.returncode == 0, result.stderr
    execution.refresh_from_db()
    assert execution.status == Status.CANCELLED
    assert "Its task was not revoked: the broker is unreachable" in result.stdout
    assert "its outcome is not recorded" in result.stdout


def test_process__retry_sends_the_new_execution(
    manage: Callable[..., subprocess.CompletedProcess[str]], redis_client: redis.Redis
) -> None:
    original = make(Status.FAILED)
    result = manage("executions", "retry", str(original.pk))
    assert result.returncode == 0, result.stderr
    retry = Execution.objects.get(retry_of=original)
    assert retry.status == Status.QUEUED
    assert redis_client.llen("celery") == 1

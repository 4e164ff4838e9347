"""What created each execution (``trigger``), every attempt's error, ``enqueued_at`` of a run-now, and past one-offs."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from project.celery import app
from scheduler import dbclock
from scheduler.beat import dispatch
from scheduler.models import Execution, Schedule
from scheduler.ops import audit, backfill, operations, reconcile
from scheduler.outbox import submissions
from scheduler.owners import executions, leases
from scheduler.owners.executions import Claim
from scheduler.tenancy import EVERY_TENANT
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
Trigger = Execution.Trigger


def _claim(execution_id: int, worker: str = "w@host:1") -> Claim:
    """Claim the execution as its own message would (its task name and task id)."""
    task, task_id = Execution.objects.filter(pk=execution_id).values_list("task", "celery_task_id").get()
    claimed = executions.claim(worker=worker, task=task, celery_task_id=task_id, execution_id=execution_id)
    assert claimed is not None
    return Claim.of(claimed)


# --- trigger ---------------------------------------------------------------------------------


def test_trigger__a_slot_the_beat_fires_is_scheduled(lease: leases.LeaseHandle) -> None:
    # Given a due schedule
    schedule = make_schedule("often")
    Schedule.objects.filter(pk=schedule.pk).update(next_run_at=dbclock.now().replace(second=0, microsecond=0))
    # When
    dispatch.dispatch_due(lease)
    # Then
    assert list(Execution.objects.values_list("trigger", flat=True)) == [Trigger.SCHEDULED]


def test_trigger__run_now_retry_backfill_submit_and_a_plain_celery_call(redis_url: str) -> None:
    schedule = make_schedule("often", interval=3600)
    # When an operator runs it now, retries that run, and backfills two past hours
    manual = operations.run_now(schedule, app=app, scope=EVERY_TENANT, actor=audit.CLI).execution
    Execution.objects.filter(pk=manual.pk).update(status=Status.SUCCEEDED)  # as its worker would have finished it
    retry = operations.retry_execution(
        Execution.objects.get(pk=manual.pk), app=app, scope=EVERY_TENANT, actor=audit.CLI
    ).execution
    now = dbclock.now()
    backfill.backfill(
        schedule, start=now - timedelta(hours=2, minutes=1), end=now - timedelta(minutes=1), now=now, app=app
    )
    # And code submits one, and sends one the plain Celery way
    submitted = submissions.submit("scheduler.echo", app=app)
    plain_key = executions.record_ad_hoc(
        "plain-id", task="scheduler.echo", args=(), kwargs={}, queue="", timeout=None, now=now
    )
    # Then
    assert Execution.objects.get(pk=manual.pk).trigger == Trigger.MANUAL
    assert Execution.objects.get(pk=retry.pk).trigger == Trigger.RETRY
    assert Execution.objects.get(pk=submitted.pk).trigger == Trigger.SUBMIT
    assert Execution.objects.get(idempotency_key=plain_key).trigger == Trigger.SUBMIT
    backfilled = Execution.objects.filter(schedule=schedule).exclude(pk__in=[manual.pk, retry.pk])
    assert list(backfilled.values_list("trigger", flat=True)) == [Trigger.BACKFILL] * 2


def test_trigger__slots_reconcile_repairs_stay_scheduled() -> None:
    # Given a schedule that owes its last slots (the leader was down)
    now = dbclock.now()
    schedule = make_schedule("often", interval=60)
    Schedule.objects.filter(pk=schedule.pk).update(
        owed_since=now - timedelta(minutes=3), next_run_at=now + timedelta(hours=1)
    )
    # When
    reconcile.reconcile(now=now, repair=True, app=app)
    # Then
    triggers = set(Execution.objects.filter(schedule=schedule).values_list("trigger", flat=True))
    assert triggers == {Trigger.SCHEDULED}


# --- every attempt's error ---------------------------------------------------------------------


def _queued(*, max_retries: int) -> Execution:
    """A queued execution of ``scheduler.echo``, due now, allowed ``max_retries`` retries."""
    return make_execution("k", status=Status.QUEUED, max_retries=max_retries, celery_task_id="c")


def test_attempt_errors__each_retried_attempt_and_the_last_are_listed() -> None:
    # Given an execution allowed two retries that fails three times
    execution = _queued(max_retries=2)
    for attempt in (1, 2):
        held = _claim(execution.pk)
        assert held.attempt == attempt
        assert executions.retry(held, delay_seconds=0, error=f"boom {attempt}")
    last = _claim(execution.pk)
    executions.finish(last, status=Status.FAILED, error="boom 3")
    # Then the row keeps the retried attempts, and show lists all three
    execution.refresh_from_db()
    assert [(e["attempt"], e["error"]) for e in execution.attempt_errors] == [(1, "boom 1"), (2, "boom 2")]
    assert all(e["at"].endswith("+00:00") for e in execution.attempt_errors)
    out = io.StringIO()
    call_command("executions", "show", str(execution.pk), "--json", stdout=out)
    shown = json.loads(out.getvalue())
    assert [(a["attempt"], a["error"]) for a in shown["attempts"]] == [(1, "boom 1"), (2, "boom 2"), (3, "boom 3")]
    out = io.StringIO()
    call_command("executions", "show", str(execution.pk), stdout=out)
    text = out.getvalue()
    assert (
        "attempt 1 error    boom 1" in text
        and "attempt 2 error    boom 2" in text
        and "attempt 3 error    boom 3" in text
    )


def test_attempt_errors__a_stale_holder_appends_nothing() -> None:
    execution = _queued(max_retries=3)
    stale = _claim(execution.pk, "a@host:1")
    Execution.objects.filter(pk=execution.pk).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))
    _claim(execution.pk, "b@host:2")
    assert not executions.retry(stale, delay_seconds=0, error="late")
    execution.refresh_from_db()
    assert execution.attempt_errors == []


def test_attempt_errors__a_lost_attempt_retried_is_listed() -> None:
    # Given a lost attempt 1
    execution = Execution.objects.create(
        idempotency_key="k", task="scheduler.echo", scheduled_for=dbclock.now(), status=Status.LOST, max_retries=1
    )
    # When reconcile retries it
    assert executions.retry_lost(execution.pk, due=dbclock.now())
    # Then
    execution.refresh_from_db()
    assert (execution.status, execution.attempt) == (Status.RETRYING, 2)
    assert [(e["attempt"], e["error"]) for e in execution.attempt_errors] == [(1, "Worker lost during attempt 1")]


# --- lost attempts and the task's own errors are counted apart -----------------------------------


def _one_retry(settings: Any) -> Execution:
    """An execution allowed one retry, with no lost-worker re-runs beyond it (``LOST_RETRIES`` 0)."""
    settings.SCHEDULER_LOST_RETRIES = 0
    return _queued(max_retries=1)


def _lose(held: Claim) -> None:
    """Let the claim ``held`` run out, as a worker that died would."""
    Execution.objects.filter(pk=held.execution_id).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))


def test_retries__an_attempt_lost_before_uses_none_of_the_tasks_retries(settings: Any) -> None:
    # Given attempt 1 lost with its worker and run again by reconcile
    execution = _one_retry(settings)
    _lose(_claim(execution.pk))
    report = reconcile.reconcile(now=dbclock.now(), app=app)
    assert [change.kind for change in report.changes] == ["lost_retrying"]
    Execution.objects.filter(pk=execution.pk).update(enqueued_at=dbclock.now())  # its backoff is over
    # When attempt 2 raises an error
    second = _claim(execution.pk)
    # Then the task's one retry is still there
    assert second.attempt == 2 and executions.retries_left(second)
    # and once used, it is gone
    assert executions.retry(second, delay_seconds=0, error="RuntimeError: boom")
    assert not executions.retries_left(_claim(execution.pk))


def test_retries__an_error_retried_before_does_not_count_as_a_lost_attempt(settings: Any) -> None:
    # Given attempt 1 that raised and was retried, and attempt 2 lost with its worker
    execution = _one_retry(settings)
    assert executions.retry(_claim(execution.pk), delay_seconds=0, error="RuntimeError: boom")
    _lose(_claim(execution.pk))
    # When reconcile finds it
    report = reconcile.reconcile(now=dbclock.now(), app=app)
    # Then it runs again: one lost attempt, one allowed
    assert [(change.kind, change.detail) for change in report.changes] == [
        ("lost_retrying", "Worker lost during attempt 2; retrying as attempt 3")
    ]


def test_retries__a_claim_taken_over_counts_as_a_lost_attempt_and_not_as_an_error(settings: Any) -> None:
    # Given attempt 1 that raised and was retried, and attempt 2 whose worker stopped renewing its claim
    execution = _one_retry(settings)
    assert executions.retry(_claim(execution.pk), delay_seconds=0, error="RuntimeError: boom")
    _lose(_claim(execution.pk, "a@host:1"))
    # When another worker takes the claim over, as attempt 3
    third = _claim(execution.pk, "b@host:2")
    # Then attempt 3 may run (one lost attempt, one allowed), but has no error retry left
    assert third.attempt == 3
    assert executions.fail_exhausted(third) is None
    assert not executions.retries_left(third)
    # And a second lost attempt is one too many: it fails with the reason
    _lose(third)
    fourth = _claim(execution.pk, "a@host:1")
    assert executions.fail_exhausted(fourth) == "Worker lost during attempt 3; no retries left"
    assert Execution.objects.get(pk=execution.pk).status == Status.FAILED


# --- enqueued_at of a run-now ----------------------------------------------------------------


@pytest.mark.parametrize("build", ["run_now", "retry"])
def test_enqueued_at__kept_when_a_worker_claimed_before_the_sender_marked_it(build: str) -> None:
    # Given a run-now (or an operator's retry) that an idle worker claimed as soon as the message arrived
    schedule = make_schedule("often")
    now = dbclock.now()
    if build == "run_now":
        execution = executions.run_now_for(schedule, now=now)
    else:
        done = Execution.objects.create(
            idempotency_key="done", task="scheduler.echo", scheduled_for=now, status=Status.FAILED
        )
        execution = executions.retry_for(done, now=now)
    executions.record_one(execution)
    _claim(execution.pk)
    # When the sender gets to mark what it sent
    assert executions.mark_queued([execution.pk], now=dbclock.now()) == 0
    # Then it still says when it was sent, and the claim is untouched
    execution.refresh_from_db()
    assert (execution.status, execution.enqueued_at) == (Status.RUNNING, now)


# --- a one-off in the past -----------------------------------------------------------------------


def _schedules(*argv: str) -> str:
    out = io.StringIO()
    call_command("schedules", *argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_one_off__create_with_a_past_time_is_refused() -> None:
    with pytest.raises(CommandError) as refused:
        _schedules("create", "once", "--task", "scheduler.echo", "--at", "2020-01-01T00:00:00Z")
    message = str(refused.value)
    assert message.startswith("The one-off time 2020-01-01 00:00:00 UTC is in the past")
    assert "--run-now" in message and "\n" not in message
    assert not Schedule.objects.exists()


def test_one_off__create_with_run_now_runs_at_once() -> None:
    before = dbclock.now()
    printed = json.loads(_schedules("create", "once", "--task", "scheduler.echo", "--run-now", "--json"))
    schedule = Schedule.objects.get(name="once")
    assert schedule.run_at is not None and before <= schedule.run_at <= dbclock.now()
    assert schedule.next_run_at == schedule.run_at and printed["schedule"]["run_at"]


def test_one_off__run_now_and_at_together_are_refused() -> None:
    with pytest.raises(CommandError, match="not allowed with argument"):
        _schedules("create", "once", "--task", "scheduler.echo", "--run-now", "--at", "2030-01-01T00:00:00Z")


def test_one_off__update_to_a_past_time_is_refused_and_changes_nothing() -> None:
    schedule = make_schedule("once", interval=None, run_at=dbclock.now() + timedelta(days=1))
    with pytest.raises(CommandError, match="is in the past.*schedules run-now once"):
        _schedules("update", "once", "--at", "2020-01-01T00:00:00Z")
    assert Schedule.objects.get(pk=schedule.pk).run_at == schedule.run_at


def test_one_off__its_description_may_change_after_its_time_passed() -> None:
    schedule = make_schedule("once", interval=None, run_at=dbclock.now() + timedelta(days=1))
    Schedule.objects.filter(pk=schedule.pk).update(run_at=dbclock.now() - timedelta(days=1))
    _schedules("update", "once", "--description", "ran yesterday")
    assert Schedule.objects.get(pk=schedule.pk).description == "ran yesterday"


def test_one_off__a_missed_slot_says_missed_not_dispatched(lease: leases.LeaseHandle) -> None:
    # Given a one-off whose time is past its catch-up window (written before the refusal existed)
    schedule = make_schedule("once", interval=None, run_at=dbclock.now() + timedelta(days=1), catchup_window=60)
    past = dbclock.now() - timedelta(hours=1)
    Schedule.objects.filter(pk=schedule.pk).update(run_at=past, next_run_at=past)
    # When the leader gets to it
    dispatch.dispatch_due(lease)
    # Then
    schedule.refresh_from_db()
    assert not schedule.enabled
    assert "was missed" in schedule.disabled_reason and "dispatched" not in schedule.disabled_reason
    assert list(Execution.objects.values_list("status", flat=True)) == [Status.MISSED]

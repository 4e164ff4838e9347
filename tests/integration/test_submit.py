"""scheduler.submit() (scheduler.outbox.submissions): validation before any write, one row per key, sent through the outbox."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import scheduler
from project.celery import app
from scheduler import dbclock
from scheduler.exceptions import SubmissionInvalid
from scheduler.models import Execution

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(task="no.such.task"), "Unknown task 'no.such.task'"),
        (dict(task="scheduler.echo", args="abc"), "args must be a list or tuple"),
        (dict(task="scheduler.echo", kwargs=[1]), "kwargs must be a dict"),
        (dict(task="scheduler.echo", kwargs={1: "a"}), "kwargs must be a dict with string keys"),
        (dict(task="scheduler.echo", args=[object()]), "must be JSON-serialisable"),
        (dict(task="scheduler.echo", timeout=0), "timeout must be a positive whole number"),
        (dict(task="scheduler.echo", timeout=-5), "timeout must be a positive whole number"),
        (dict(task="scheduler.echo", timeout=2**31), "timeout must be at most 2147483647"),
        (dict(task="scheduler.echo", countdown=-1), "countdown must be a number of seconds from 0"),
        (dict(task="scheduler.echo", countdown=1e20), "countdown must be a number of seconds from 0"),
        (dict(task="scheduler.echo", countdown=float("nan")), "countdown must be a number of seconds from 0"),
        (dict(task="scheduler.echo", countdown="5"), "countdown must be a number of seconds from 0"),
        (dict(task="scheduler.echo", max_retries=-1), "max_retries must be a whole number from 0 to 2147483647"),
        (dict(task="scheduler.echo", max_retries=2**31), "max_retries must be a whole number from 0 to 2147483647"),
        (dict(task="scheduler.echo", retry_backoff=2**40), "retry_backoff must be a whole number from 0 to 2147483647"),
        (dict(task="scheduler.echo", idempotency_key=""), "idempotency_key must be 1 to 255"),
        (dict(task="scheduler.echo", idempotency_key="k" * 256), "idempotency_key must be 1 to 255"),
    ],
)
def test_submit__bad_input_refused_before_anything_is_written(
    call: dict[str, Any], message: str, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    with django_capture_on_commit_callbacks() as callbacks, pytest.raises(SubmissionInvalid, match=message):
        scheduler.submit(**call)
    assert Execution.objects.count() == 0
    assert callbacks == []


def test_submit__records_a_pending_execution_and_sends_it_on_commit(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    with django_capture_on_commit_callbacks() as callbacks:
        execution = scheduler.submit(
            "scheduler.echo", args=[1], kwargs={"a": 2}, timeout=30, queue="reports", max_retries=2, retry_backoff=5
        )
    assert len(callbacks) == 1
    execution.refresh_from_db()
    assert (execution.status, execution.task, execution.args, execution.kwargs) == (
        "pending",
        "scheduler.echo",
        [1],
        {"a": 2},
    )
    assert (execution.timeout, execution.queue, execution.max_retries, execution.retry_backoff) == (30, "reports", 2, 5)
    assert execution.schedule is None and execution.celery_task_id
    assert execution.idempotency_key.startswith("submit:")


def test_submit__same_key_returns_the_existing_execution_and_sends_nothing(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> None:
    with django_capture_on_commit_callbacks() as first:
        execution = scheduler.submit("scheduler.echo", idempotency_key="invoice-7")
    with django_capture_on_commit_callbacks() as second:
        again = scheduler.submit("scheduler.echo", args=[99], idempotency_key="invoice-7")
    assert again.pk == execution.pk and again.args == []
    assert (len(first), len(second)) == (1, 0)
    assert Execution.objects.count() == 1


def test_submit__countdown_schedules_it_later() -> None:
    before = dbclock.now()
    execution = scheduler.submit("scheduler.echo", countdown=60)
    assert execution.scheduled_for >= before + timedelta(seconds=60)


def test_current_execution__none_outside_a_task() -> None:
    assert scheduler.current_execution() is None


def test_submit__broker_down__recorded_pending_for_the_leader_and_returned(
    broker_down: None, django_capture_on_commit_callbacks: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Given a broker nobody listens on
    # When a submission commits
    with django_capture_on_commit_callbacks(execute=True):
        execution = scheduler.submit("scheduler.echo", app=app)
    # Then it is recorded, left pending for the beat leader, and the caller is told nothing failed
    execution.refresh_from_db()
    assert execution.status == Execution.Status.PENDING
    (deferred,) = [record for record in caplog.records if getattr(record, "action", "") == "submit_deferred"]
    assert "the beat leader will send it" in deferred.getMessage()

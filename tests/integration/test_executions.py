"""The owner of an Execution's life: the transition table, and writes fenced by the claim's attempt."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import time_machine

from scheduler import dbclock
from scheduler.models import Execution
from scheduler.owners import executions
from scheduler.owners.executions import Claim

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
#: Columns a stale holder must never change on its successor's row.
WATCHED = ("status", "attempt", "worker", "claim_expires_at", "finished_at", "error", "result", "enqueued_at")


def row(status: str = Status.QUEUED, *, key: str = "e", **fields: Any) -> Execution:
    fields.setdefault("celery_task_id", f"celery-{key}")
    return Execution.objects.create(
        idempotency_key=key, task="scheduler.echo", scheduled_for=dbclock.now(), status=status, **fields
    )


def state(execution_id: int) -> dict[str, Any]:
    return Execution.objects.filter(pk=execution_id).values(*WATCHED).get()


def expire_claim(execution_id: int) -> None:
    """Make the running row's claim run out, as a holder that froze past it would."""
    Execution.objects.filter(pk=execution_id).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))


def claimed(execution_id: int, worker: str) -> Claim:
    task, task_id = Execution.objects.filter(pk=execution_id).values_list("task", "celery_task_id").get()
    execution = executions.claim(worker=worker, task=task, celery_task_id=task_id, execution_id=execution_id)
    assert execution is not None, f"{worker} could not claim execution {execution_id}"
    return Claim.of(execution)


def superseded() -> tuple[Claim, Claim]:
    """Worker A claims an execution as attempt 1; A's claim expires and worker B takes it over as attempt 2."""
    execution = row()
    stale = claimed(execution.pk, "a@host:1")
    expire_claim(execution.pk)
    current = claimed(execution.pk, "b@host:2")
    assert (stale.attempt, current.attempt) == (1, 2)
    return stale, current


# --- the transition table ---------------------------------------------------------------


@pytest.mark.parametrize("source", Status.values)
def test_transitions__only_the_moves_in_the_table_change_a_row(source: str) -> None:
    for target in Status.values:
        # Given an execution in ``source``
        Execution.objects.all().delete()
        execution = row(source)
        # When the owner moves it to ``target``
        moved = executions._move(Execution.objects.filter(pk=execution.pk), target)
        # Then it moved exactly when the table allows it
        allowed = target in Execution.TRANSITIONS[source]
        assert (moved, state(execution.pk)["status"]) == ((1, target) if allowed else (0, source)), (source, target)


def test_transitions__every_status_has_an_entry_and_final_ones_lead_nowhere() -> None:
    assert set(Execution.TRANSITIONS) == set(Status.values)
    assert all(not Execution.TRANSITIONS[status] for status in Execution.FINAL_STATUSES)


@pytest.mark.parametrize("final", sorted(Execution.FINAL_STATUSES))
def test_finished_execution__refuses_claim_cancel_queue_fail_and_retry(final: str) -> None:
    # Given a finished execution
    execution = row(final)
    before = state(execution.pk)
    # When every owner function that starts from a live state is tried on it
    assert (
        executions.claim(
            worker="w@host:1", task=execution.task, celery_task_id=execution.celery_task_id, execution_id=execution.pk
        )
        is None
    )
    assert not executions.cancel(execution.pk, reason="no", now=dbclock.now())
    assert executions.mark_queued([execution.pk], now=dbclock.now()) == 0
    assert not executions.fail_unrun(
        execution.pk, task=execution.task, celery_task_id=execution.celery_task_id, reason="no"
    )
    assert not executions.retry_lost(execution.pk, due=dbclock.now())
    assert not executions.fail_lost(execution, reason="no")
    # Then nothing changed
    assert state(execution.pk) == before


def test_running_execution__not_failed_as_unrun_nor_retried_as_lost() -> None:
    execution = row()
    claimed(execution.pk, "w@host:1")
    before = state(execution.pk)
    assert not executions.fail_unrun(
        execution.pk, task=execution.task, celery_task_id=execution.celery_task_id, reason="refused"
    )
    assert not executions.retry_lost(execution.pk, due=dbclock.now())
    assert executions.mark_queued([execution.pk], now=dbclock.now()) == 0
    assert state(execution.pk) == before


# --- attempts: one increment per new holder ----------------------------------------------


def test_attempt__grows_once_for_each_new_holder_and_never_for_the_same_one() -> None:
    # Given a queued execution, claimed: attempt 1
    execution = row()
    first = claimed(execution.pk, "a@host:1")
    assert first.attempt == 1
    # When its claim expires and another worker takes over: attempt 2
    expire_claim(execution.pk)
    second = claimed(execution.pk, "b@host:2")
    assert second.attempt == 2
    # When that holder retries: attempt 3 waits, and claiming it keeps 3
    assert executions.retry(second, delay_seconds=0)
    assert state(execution.pk)["status"] == Status.RETRYING
    third = claimed(execution.pk, "a@host:1")
    assert third.attempt == 3
    # When its holder is lost and reconcile retries it: attempt 4
    expire_claim(execution.pk)
    assert executions.mark_lost([execution.pk]) == 1
    assert executions.retry_lost(execution.pk, due=dbclock.now())
    assert claimed(execution.pk, "b@host:2").attempt == 4


def test_undo_retry__gives_the_attempt_back_only_while_nobody_claimed_the_retry() -> None:
    execution = row()
    held = claimed(execution.pk, "a@host:1")
    assert executions.retry(held, delay_seconds=0)
    assert executions.undo_retry(held)
    assert (state(execution.pk)["status"], state(execution.pk)["attempt"]) == (Status.RUNNING, 1)
    # When the retry was claimed by someone else before the undo
    assert executions.retry(held, delay_seconds=0)
    successor = claimed(execution.pk, "b@host:2")
    before = state(execution.pk)
    # Then the undo changes nothing
    assert not executions.undo_retry(held)
    assert state(execution.pk) == before and successor.attempt == 2


# --- fenced writes: a stale claim changes nothing ------------------------------------------

FENCED: dict[str, Callable[[Claim], object]] = {
    "renew": lambda claim: executions.renew([claim], seconds=600),
    "finish": lambda claim: executions.finish(claim, status=Status.SUCCEEDED, result="stale"),
    "fail": lambda claim: executions.finish(claim, status=Status.FAILED, error="stale"),
    "time_out": lambda claim: executions.finish(claim, status=Status.TIMED_OUT, error="stale"),
    "retry": lambda claim: executions.retry(claim, delay_seconds=0, error="stale"),
    "release": executions.release,
}


@pytest.mark.parametrize("write", sorted(FENCED))
def test_fenced_write__by_a_superseded_claim_leaves_the_successor_untouched(write: str) -> None:
    # Given attempt 1 (worker A) superseded by attempt 2 (worker B)
    stale, current = superseded()
    before = state(current.execution_id)
    # When A writes with its old claim
    outcome = FENCED[write](stale)
    # Then nothing was written, and B's claim is intact
    assert not outcome
    assert state(current.execution_id) == before
    assert executions.finish(current, status=Status.SUCCEEDED, result="b")
    assert state(current.execution_id)["status"] == Status.SUCCEEDED


@pytest.mark.parametrize("write", sorted(FENCED))
def test_fenced_write__by_the_current_claim_applies(write: str) -> None:
    _, current = superseded()
    assert FENCED[write](current)


def test_fenced_write__after_an_operator_cancelled_changes_nothing() -> None:
    execution = row()
    held = claimed(execution.pk, "a@host:1")
    assert executions.cancel(execution.pk, reason="operator", now=dbclock.now())
    before = state(execution.pk)
    assert not executions.finish(held, status=Status.SUCCEEDED)
    assert not executions.renew([held], seconds=600)
    assert state(execution.pk) == before


def test_held_by__finds_only_the_claim_that_process_made() -> None:
    # Given A's claim superseded by B's
    stale, current = superseded()
    # Then A's identity holds nothing any more, and B's holds attempt 2
    assert executions.held_by(worker="a@host:1", execution_id=stale.execution_id) is None
    held = executions.held_by(worker="b@host:2", execution_id=current.execution_id)
    assert held is not None and held.attempt == 2


def test_renew__extends_only_the_claims_still_held() -> None:
    # Given two running executions, one of whose claims was superseded
    stale, _ = superseded()
    other = claimed(row(key="other").pk, "a@host:1")
    # When A renews both in one statement
    renewed = executions.renew([stale, other], seconds=600)
    # Then only the one A still holds was renewed
    assert renewed == {other}
    assert state(other.execution_id)["claim_expires_at"] > dbclock.now() + timedelta(seconds=500)


def test_moved_on__names_the_claims_lost_and_not_those_their_holder_ended() -> None:
    # Given A's claim superseded by B's, another claim A still holds, and one A finished itself
    stale, current = superseded()
    other = claimed(row(key="other").pk, "a@host:1")
    done = claimed(row(key="done").pk, "a@host:1")
    executions.finish(done, status=Status.SUCCEEDED)
    # Then only the superseded one moved on
    assert executions.moved_on([stale, other, done]) == {stale}
    # And so does a claim an operator cancelled
    executions.cancel(current.execution_id, reason="operator", now=dbclock.now())
    assert executions.moved_on([current]) == {current}


# --- claims of executions with a time limit ---------------------------------------------------


def claim_length(execution_id: int) -> timedelta:
    values = Execution.objects.filter(pk=execution_id).values("started_at", "claim_expires_at").get()
    return values["claim_expires_at"] - values["started_at"]


@pytest.mark.parametrize(("timeout", "seconds"), [(None, 30), (5, 30), (100, 110)])
def test_claim__lasts_at_least_until_the_hard_time_limit(settings: Any, timeout: int | None, seconds: float) -> None:
    settings.SCHEDULER_CLAIM_SECONDS = 30
    settings.SCHEDULER_TIMEOUT_GRACE_SECONDS = 10
    # Given an execution with that timeout
    execution = row(timeout=timeout)
    # When a worker claims it
    claimed(execution.pk, "a@host:1")
    # Then its claim lasts the claim, or to the hard limit (timeout + grace) when that is later
    assert timedelta(seconds=seconds) <= claim_length(execution.pk) < timedelta(seconds=seconds + 1)


def test_renew__never_shortens_a_claim_to_the_hard_time_limit(settings: Any) -> None:
    settings.SCHEDULER_TIMEOUT_GRACE_SECONDS = 10
    # Given a claimed execution whose hard time limit is 110 s after its claim
    execution = row(timeout=100)
    held = claimed(execution.pk, "a@host:1")
    # When its worker renews it for 3 s
    assert executions.renew([held], seconds=3) == {held}
    # Then the claim still lasts to the hard limit: reconcile finds nothing lost
    assert claim_length(execution.pk) >= timedelta(seconds=110)
    assert executions.mark_lost([execution.pk]) == 0
    assert not Execution.objects.claimable().filter(pk=execution.pk).exists()
    # And a claim without a time limit is renewed by the 3 s asked
    plain = claimed(row(key="plain").pk, "a@host:1")
    expire_claim(plain.execution_id)
    assert executions.renew([plain], seconds=3) == {plain}
    assert dbclock.now() < state(plain.execution_id)["claim_expires_at"] < dbclock.now() + timedelta(seconds=4)


# --- settings: "lease" is the beat's, a worker holds a claim ---------------------------------


def test_claim_settings__deprecated_names_still_read_and_new_names_win(settings: Any) -> None:
    from scheduler.conf import settings as scheduler_settings

    # Given only the deprecated names
    settings.SCHEDULER_EXECUTION_LEASE_SECONDS = 7.0
    settings.SCHEDULER_EXECUTION_RENEW_SECONDS = 2.0
    # Then the claim settings read them
    assert (scheduler_settings.CLAIM_SECONDS, scheduler_settings.CLAIM_RENEW_SECONDS) == (7.0, 2.0)
    # And the new name wins when both are set
    settings.SCHEDULER_CLAIM_SECONDS = 9.0
    assert scheduler_settings.CLAIM_SECONDS == 9.0
    # And each deprecated name set is a warning naming its replacement and the release that drops it
    from scheduler import checks

    warnings = checks.check_deprecated_settings()
    assert [warning.id for warning in warnings] == ["scheduler.W003"] * 2
    assert "SCHEDULER_EXECUTION_LEASE_SECONDS" in warnings[0].msg and "0.3.0" in warnings[0].msg
    assert warnings[0].hint == "Rename it to SCHEDULER_CLAIM_SECONDS."
    del settings.SCHEDULER_EXECUTION_LEASE_SECONDS, settings.SCHEDULER_EXECUTION_RENEW_SECONDS
    assert checks.check_deprecated_settings() == []


# --- a retry waits for its due time -------------------------------------------------------------


def test_retrying__claimable_only_once_its_retry_is_due() -> None:
    # Given an execution whose attempt 1 failed and is retried in 30 s
    execution = row()
    held = claimed(execution.pk, "a@host:1")
    assert executions.retry(held, delay_seconds=30)
    # When a duplicate of its message comes before then
    early = executions.claim(
        worker="b@host:2", task=execution.task, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    # Then it claims nothing: the retry waits for its backoff
    assert early is None
    assert state(execution.pk)["status"] == Status.RETRYING
    assert not Execution.objects.claimable().filter(pk=execution.pk).exists()
    assert 25 < executions.retry_due_in(execution_id=execution.pk) <= 30
    # When the retry is due (database clock)
    Execution.objects.filter(pk=execution.pk).update(enqueued_at=dbclock.now() - timedelta(milliseconds=1))
    # Then a message claims it, as attempt 2
    assert executions.retry_due_in(execution_id=execution.pk) is None
    assert claimed(execution.pk, "b@host:2").attempt == 2


# --- created_at is the database's clock ---------------------------------------------------------

RECORD: dict[str, Callable[[], object]] = {
    "insert": lambda: executions.insert(
        [Execution(idempotency_key="e", task="scheduler.echo", scheduled_for=dbclock.now(), celery_task_id="c")]
    ),
    "record_one": lambda: executions.record_one(
        Execution(idempotency_key="e", task="scheduler.echo", scheduled_for=dbclock.now(), celery_task_id="c")
    ),
    "record_ad_hoc": lambda: executions.record_ad_hoc(
        "c", task="scheduler.echo", args=[], kwargs={}, queue="", timeout=None, now=dbclock.now()
    ),
}


@pytest.mark.parametrize("path", sorted(RECORD))
def test_created_at__the_database_clock_whatever_the_local_one(path: str) -> None:
    # Given a process whose clock runs a day ahead of the database's
    before = dbclock.now()
    with time_machine.travel(before + timedelta(days=1), tick=True):
        # When an execution is recorded by that path
        RECORD[path]()
    after = dbclock.now()
    # Then it was created at the database's time, as every later move of it is
    assert before <= Execution.objects.get(idempotency_key__in=["e", "celery:c"]).created_at <= after

"""``scheduler.fenced()`` and checkpoints, run in-process under the execution guard (``tests.support.in_process_guard``)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction

import scheduler
from scheduler import dbclock
from scheduler.exceptions import CheckpointInvalid, ClaimLost, FenceRefused, NotInTask
from scheduler.models import Execution
from scheduler.owners import executions, schedules
from scheduler.worker.running import CHECKPOINT_MAX_BYTES
from tests.support.in_process_guard import fresh, queued, run
from tests.support.tasks import SIDE_EFFECT_TABLE, side_effects

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("no_background_renewal")]

Status = Execution.Status
SUCCESSOR = "b@elsewhere:4242"


def invoice() -> None:
    running = scheduler.current_execution()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {SIDE_EFFECT_TABLE} (execution_id, attempt, pid) VALUES (%s, %s, 0)",
            [running.pk, running.attempt],
        )


def take_over() -> None:
    """Let another worker claim the running execution as the next attempt, as after a freeze past the claim."""
    running = scheduler.current_execution()
    Execution.objects.filter(pk=running.pk).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))
    successor = executions.claim(
        worker=SUCCESSOR, task=running.task, celery_task_id=running.celery_task_id, execution_id=running.pk
    )
    assert successor is not None


# --- fenced() ---------------------------------------------------------------------------


def test_fenced__outside_a_task__refused() -> None:
    with pytest.raises(NotInTask, match=r"fenced\(\) works only inside a task"):
        with scheduler.fenced():
            pass
    assert scheduler.current_execution() is None


def test_fenced__commits_the_block_with_the_outcome_counted_once(side_effect_table: None) -> None:
    # Given an execution of a schedule
    schedule = schedules.create(name="invoices", task="tests.integration.body", interval=60)
    execution = queued(schedule=schedule)

    def step() -> str:
        with scheduler.fenced():
            invoice()
            # Inside the block nothing is committed yet: the outcome waits for the block
            assert fresh(execution).status == Status.RUNNING
        return "invoiced"

    # When its body writes its invoice in a fenced block, then returns
    assert run(execution, step) == "invoiced"
    # Then the invoice, the succeeded outcome and the returned result are all there, counted once
    assert side_effects() == [(execution.pk, 1, 0)]
    done = fresh(execution)
    assert (done.status, done.attempt, done.result) == (Status.SUCCEEDED, 1, "invoiced")
    assert done.claim_expires_at is None and done.finished_at is not None
    schedule.refresh_from_db()
    assert (schedule.total_runs, schedule.last_status, schedule.consecutive_failures) == (1, Status.SUCCEEDED, 0)


def test_fenced__claim_moved_on__block_rolled_back_and_successor_untouched(side_effect_table: None) -> None:
    execution = queued()
    successor: dict[str, Any] = {}

    def step() -> None:
        # Given another worker claimed the execution as attempt 2 while this one ran
        take_over()
        successor.update(Execution.objects.filter(pk=execution.pk).values("status", "attempt", "worker").get())
        # When this attempt writes its invoice in a fenced block
        with scheduler.fenced():
            invoice()

    # Then the block raises ClaimLost and its invoice was rolled back
    with pytest.raises(ClaimLost, match=r"attempt 1: the claim moved on .* the fenced block was rolled back"):
        run(execution, step)
    assert side_effects() == []
    # And the successor's claim is as it wrote it
    assert successor == {"status": Status.RUNNING, "attempt": 2, "worker": SUCCESSOR}
    assert Execution.objects.filter(pk=execution.pk).values("status", "attempt", "worker").get() == successor


def test_fenced__block_raises__rolled_back_and_the_error_recorded(side_effect_table: None) -> None:
    execution = queued()

    def step() -> None:
        with scheduler.fenced():
            invoice()
            raise ValueError("card declined")

    with pytest.raises(ValueError, match="card declined"):
        run(execution, step)
    assert side_effects() == []
    done = fresh(execution)
    assert (done.status, done.error) == (Status.FAILED, "ValueError: card declined")


def test_fenced__a_second_block__refused_and_the_outcome_kept(side_effect_table: None) -> None:
    execution = queued()

    def step() -> None:
        with scheduler.fenced():
            invoice()
        with scheduler.fenced():
            invoice()

    with pytest.raises(FenceRefused, match=r"fenced\(\) after a fenced block committed"):
        run(execution, step)
    assert len(side_effects()) == 1
    assert fresh(execution).status == Status.SUCCEEDED


def test_fenced__inside_an_open_transaction__refused(side_effect_table: None) -> None:
    execution = queued()

    def step() -> None:
        with transaction.atomic():
            with scheduler.fenced():
                invoice()

    with pytest.raises(FenceRefused, match=r"inside transaction.atomic\(\)"):
        run(execution, step)
    assert side_effects() == []
    assert fresh(execution).status == Status.FAILED


# --- checkpoints --------------------------------------------------------------------------


def test_checkpoint__saved_and_read_back_by_the_attempt() -> None:
    # Given an execution an earlier attempt left progress on
    execution = queued(progress={"done": 2})
    seen: list[Any] = []

    def step() -> None:
        running = scheduler.current_execution()
        seen.append(running.last_checkpoint)
        running.checkpoint({"done": 3, "cursor": ("a", 1)})
        seen.append(running.last_checkpoint)

    # When this attempt reads it and saves its own
    run(execution, step)
    # Then it read the earlier one, and the row holds the new one, as JSON
    assert seen == [{"done": 2}, {"done": 3, "cursor": ["a", 1]}]
    assert fresh(execution).progress == {"done": 3, "cursor": ["a", 1]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (object(), r"checkpoint refused, it is not JSON: Object of type object"),
        ({"rate": math.nan}, r"checkpoint refused, it is not JSON: Out of range float"),
        ("x" * CHECKPOINT_MAX_BYTES, rf"checkpoint refused: its JSON is {CHECKPOINT_MAX_BYTES + 2} bytes, more than"),
    ],
    ids=["not-json", "nan", "too-large"],
)
def test_checkpoint__bad_data__refused_and_nothing_saved(data: Any, message: str) -> None:
    execution = queued(progress={"done": 1})
    with pytest.raises(CheckpointInvalid, match=message):
        run(execution, lambda: scheduler.current_execution().checkpoint(data))
    assert fresh(execution).progress == {"done": 1}


def test_checkpoint__claim_moved_on__refused_and_the_successors_progress_kept() -> None:
    execution = queued(progress={"done": 1})

    def step() -> None:
        take_over()
        scheduler.current_execution().checkpoint({"done": 99})

    with pytest.raises(ClaimLost, match=r"its checkpoint was not saved"):
        run(execution, step)
    assert Execution.objects.filter(pk=execution.pk).values_list("progress", "attempt").get() == ({"done": 1}, 2)


def test_checkpoint__after_the_task_ended__refused() -> None:
    # Given a body that kept its execution after returning
    execution = queued()
    kept = run(execution, scheduler.current_execution)
    # Then a checkpoint on it is refused: its claim ended with the outcome
    with pytest.raises(ClaimLost):
        kept.checkpoint({"done": 1})
    assert fresh(execution).progress is None


@pytest.mark.parametrize("where", ["inside", "after"])
def test_checkpoint__inside_or_after_a_fenced_block__refused(side_effect_table: None, where: str) -> None:
    execution = queued()

    def step() -> None:
        running = scheduler.current_execution()
        with scheduler.fenced():
            invoice()
            if where == "inside":
                running.checkpoint({"done": 1})
        running.checkpoint({"done": 1})

    with pytest.raises(FenceRefused, match=r"checkpoint\(\)"):
        run(execution, step)
    assert fresh(execution).progress is None

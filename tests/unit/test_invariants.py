"""The fault runs' result check (``tests.support.invariants.result_violations``): what contradicts a row, what does not."""

from __future__ import annotations

import pytest

from scheduler.models import Execution
from tests.support import invariants

Status = Execution.Status


def row(pk: int, status: str) -> Execution:
    return Execution(pk=pk, status=status, celery_task_id=f"task-{pk}")


@pytest.mark.parametrize(
    ("status", "stored"),
    [
        (Status.SUCCEEDED, "FAILURE"),  # a late attempt's ClaimLost stored over the successor's success
        (Status.SUCCEEDED, "RETRY"),
        (Status.FAILED, "SUCCESS"),  # a late attempt's value stored over the recorded failure
        (Status.TIMED_OUT, "SUCCESS"),
    ],
)
def test_a_stored_result_saying_otherwise_than_the_row__is_a_violation(status: str, stored: str) -> None:
    assert invariants.result_violations([row(1, status)], {"task-1": stored}) == [1]


@pytest.mark.parametrize(
    ("status", "stored"),
    [
        (Status.SUCCEEDED, "SUCCESS"),
        (Status.FAILED, "FAILURE"),
        (Status.TIMED_OUT, "FAILURE"),
        (Status.CANCELLED, "SUCCESS"),  # a cancel recorded over a body that finished: the row decides nothing here
        (Status.SUCCEEDED, None),  # none stored: a worker died between the outcome and Celery's own store
    ],
)
def test_a_stored_result_agreeing_or_absent__is_none(status: str, stored: str | None) -> None:
    results = {} if stored is None else {"task-1": stored}
    assert invariants.result_violations([row(1, status)], results) == []

"""A claim verifies the message, not only its header: task name and task id must be the execution's own."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client

from scheduler import dbclock
from scheduler.exceptions import MessageRefused
from scheduler.models import Execution
from scheduler.owners import executions

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
TASK = "tests.record"
REFUSED = re.compile(r"^scheduler_messages_refused_total\{reason=\"(\w+)\"\} (\S+)$", re.MULTILINE)
#: A row as the claim may find it: waiting to be claimed, or running under a claim that expired.
CLAIMABLE = [Status.PENDING, Status.QUEUED, Status.RETRYING, "expired"]


def recorded(state: str = Status.QUEUED, *, key: str = "b") -> Execution:
    """Record an execution as the senders do: its Celery task id chosen with the row."""
    expired = state == "expired"
    execution = Execution.objects.create(
        idempotency_key=key,
        task=TASK,
        tenant="b",
        scheduled_for=dbclock.now(),
        celery_task_id=str(uuid.uuid4()),
        status=Status.RUNNING if expired else state,
        worker="b@host:1" if expired else "",
        claim_expires_at=dbclock.now() - timedelta(seconds=5) if expired else None,
    )
    return execution


def row_state(execution_id: int) -> dict[str, Any]:
    return Execution.objects.filter(pk=execution_id).values().get()


def refused_counts() -> dict[str, float]:
    response = Client().get("/metrics")
    assert response.status_code == 200
    return {reason: float(value) for reason, value in REFUSED.findall(response.content.decode())}


@pytest.mark.parametrize("state", CLAIMABLE)
def test_claim__refuses_a_message_with_another_task_name(state: str) -> None:
    # Given tenant B's claimable execution
    execution = recorded(state)
    before = row_state(execution.pk)
    # When a message names it under another task name (with its own task id)
    with pytest.raises(MessageRefused) as refused:
        executions.claim(
            worker="a@host:2", task="tests.steps", celery_task_id=execution.celery_task_id, execution_id=execution.pk
        )
    # Then it is refused with both sides' ids, counted, and the row is untouched
    assert (refused.value.reason, refused.value.execution_id) == ("task_mismatch", execution.pk)
    assert (refused.value.task, refused.value.celery_task_id) == (TASK, execution.celery_task_id)
    assert (refused.value.message_task, refused.value.message_task_id) == ("tests.steps", execution.celery_task_id)
    assert row_state(execution.pk) == before
    assert refused_counts() == {
        "task_mismatch": 1.0,
        "task_id_mismatch": 0.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }


@pytest.mark.parametrize("state", CLAIMABLE)
def test_claim__refuses_a_message_with_another_task_id(state: str) -> None:
    # Given tenant B's claimable execution
    execution = recorded(state)
    before = row_state(execution.pk)
    # When a message names it under its task name but another task id
    other = str(uuid.uuid4())
    with pytest.raises(MessageRefused) as refused:
        executions.claim(worker="a@host:2", task=TASK, celery_task_id=other, execution_id=execution.pk)
    # Then it is refused, counted, and the row is untouched
    assert (refused.value.reason, refused.value.message_task_id) == ("task_id_mismatch", other)
    assert refused.value.celery_task_id == execution.celery_task_id
    assert row_state(execution.pk) == before
    assert refused_counts() == {
        "task_mismatch": 0.0,
        "task_id_mismatch": 1.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }


@pytest.mark.parametrize("state", CLAIMABLE)
def test_claim__the_message_sent_for_the_execution_claims_it(state: str) -> None:
    # Given tenant B's claimable execution
    execution = recorded(state)
    # When its own message comes
    claimed = executions.claim(
        worker="b@host:2", task=TASK, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    # Then it claims the row, whose task id stays what it was recorded with
    assert claimed is not None and claimed.pk == execution.pk
    assert (claimed.status, claimed.worker) == (Status.RUNNING, "b@host:2")
    assert claimed.attempt == (2 if state == "expired" else 1)
    assert row_state(execution.pk)["celery_task_id"] == execution.celery_task_id
    # And a second copy of it is a duplicate: nothing claimed, nothing refused
    again = executions.claim(
        worker="b@host:3", task=TASK, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    assert again is None
    assert refused_counts() == {
        "task_mismatch": 0.0,
        "task_id_mismatch": 0.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }


def test_claim__a_finished_execution_refuses_a_foreign_message_and_ignores_its_own() -> None:
    # Given a finished execution
    execution = recorded(Status.SUCCEEDED)
    before = row_state(execution.pk)
    # When a foreign message names it, then a late copy of its own
    with pytest.raises(MessageRefused):
        executions.claim(worker="a@host:2", task="tests.steps", celery_task_id="x", execution_id=execution.pk)
    own = executions.claim(
        worker="b@host:2", task=TASK, celery_task_id=execution.celery_task_id, execution_id=execution.pk
    )
    # Then the foreign one is refused, the own one is a duplicate, and nothing changed
    assert own is None
    assert row_state(execution.pk) == before


def test_claim__a_message_for_an_unknown_execution_claims_nothing() -> None:
    assert executions.claim(worker="a@host:2", task=TASK, celery_task_id="x", execution_id=10**9) is None
    assert refused_counts() == {
        "task_mismatch": 0.0,
        "task_id_mismatch": 0.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }


def test_claim_by_key__a_plain_celery_call_claims_its_own_row_and_refuses_another_task_under_its_id() -> None:
    # Given a plain Celery call recorded as an ad-hoc execution keyed by its task id
    task_id = str(uuid.uuid4())
    key = executions.record_ad_hoc(task_id, task=TASK, args=[], kwargs={}, queue="", timeout=None, now=dbclock.now())
    execution = Execution.objects.get(idempotency_key=key)
    before = row_state(execution.pk)
    # When a message of another task arrives under the same task id (recording its own row changes nothing)
    assert (
        executions.record_ad_hoc(
            task_id, task="tests.steps", args=[], kwargs={}, queue="", timeout=None, now=dbclock.now()
        )
        == key
    )
    with pytest.raises(MessageRefused) as refused:
        executions.claim(worker="a@host:2", task="tests.steps", celery_task_id=task_id, key=key)
    # Then it is refused and the row is untouched
    assert (refused.value.reason, refused.value.execution_id) == ("task_mismatch", execution.pk)
    assert row_state(execution.pk) == before
    # And the call's own message claims it
    claimed = executions.claim(worker="b@host:2", task=TASK, celery_task_id=task_id, key=key)
    assert claimed is not None and claimed.pk == execution.pk and claimed.status == Status.RUNNING


def test_refusals__counted_per_reason_and_kept_out_of_the_execution_counters() -> None:
    # Given two executions
    first, second = recorded(key="one"), recorded(key="two")
    # When three foreign messages name them
    for execution, task, task_id in (
        (first, "tests.steps", first.celery_task_id),
        (second, "tests.steps", "x"),
        (second, TASK, "y"),
    ):
        with pytest.raises(MessageRefused):
            executions.claim(worker="a@host:2", task=task, celery_task_id=task_id, execution_id=execution.pk)
    # Then /metrics counts each by its reason, and no execution counter moved
    assert refused_counts() == {
        "task_mismatch": 2.0,
        "task_id_mismatch": 1.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }
    assert "scheduler_executions_total{" not in Client().get("/metrics").content.decode()


def test_fail_unrun__only_by_the_message_sent_for_the_execution() -> None:
    # Given tenant B's queued execution
    execution = recorded()
    before = row_state(execution.pk)
    # When a worker rejected messages that name it under another task name, or another task id
    for task, task_id in (("no.such.task", execution.celery_task_id), (TASK, "x")):
        with pytest.raises(MessageRefused):
            executions.fail_unrun(execution.pk, task=task, celery_task_id=task_id, reason="rejected")
    # Then the row is untouched and both are counted
    assert row_state(execution.pk) == before
    assert refused_counts() == {
        "task_mismatch": 1.0,
        "task_id_mismatch": 1.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }
    # And when it rejected the message sent for it, the execution fails with the reason
    assert executions.fail_unrun(execution.pk, task=TASK, celery_task_id=execution.celery_task_id, reason="rejected")
    assert (row_state(execution.pk)["status"], row_state(execution.pk)["error"]) == (Status.FAILED, "rejected")


def test_record_ad_hoc_claimed__one_statement_records_it_running_and_a_second_delivery_writes_nothing() -> None:
    # Given a plain Celery call's task id
    task_id = str(uuid.uuid4())
    call = {"task": TASK, "args": [1], "kwargs": {"a": 2}, "queue": "q", "timeout": None, "now": dbclock.now()}

    # When its worker records it claimed, and a redelivery tries the same
    claimed = executions.record_ad_hoc_claimed(task_id, worker="a@host:2", **call)
    again = executions.record_ad_hoc_claimed(task_id, worker="b@host:3", **call)

    # Then one row, running under the first worker's claim, from the database clock; the second wrote nothing
    assert claimed is not None and again is None
    row = Execution.objects.get()
    assert (row.pk, row.status, row.worker, row.attempt) == (claimed.pk, Status.RUNNING, "a@host:2", claimed.attempt)
    assert (row.idempotency_key, row.trigger, row.args, row.kwargs) == (
        executions.ad_hoc_key(task_id),
        Execution.Trigger.SUBMIT,
        [1],
        {"a": 2},
    )
    assert row.started_at is not None and row.claim_expires_at is not None and row.claim_expires_at > row.started_at
    # and the redelivery, claimed by its key as usual, finds it held (a duplicate)
    assert executions.claim(worker="b@host:3", task=TASK, celery_task_id=task_id, key=row.idempotency_key) is None


#: Task ids no row can hold: PostgreSQL refuses a NUL character in text, and its ad-hoc key would pass 255 characters.
UNRECORDABLE_TASK_IDS = ["a\x00b", "z" * (executions.MAX_TASK_ID_LENGTH + 1)]


@pytest.mark.parametrize("task_id", UNRECORDABLE_TASK_IDS, ids=["nul", "too-long"])
def test_unrecordable_task_id__refused_by_every_writer_before_any_statement(task_id: str) -> None:
    # Given tenant B's queued execution
    execution = recorded()
    before = row_state(execution.pk)
    call = {"task": TASK, "args": [], "kwargs": {}, "queue": "", "timeout": None, "now": dbclock.now()}
    # When a message with such a task id is claimed, recorded as a plain call, or failed unrun
    attempts = (
        lambda: executions.claim(worker="a@host:2", task=TASK, celery_task_id=task_id, execution_id=execution.pk),
        lambda: executions.claim(worker="a@host:2", task=TASK, celery_task_id=task_id, key="celery:x"),
        lambda: executions.record_ad_hoc(task_id, **call),
        lambda: executions.record_ad_hoc_claimed(task_id, worker="a@host:2", **call),
        lambda: executions.fail_unrun(execution.pk, task=TASK, celery_task_id=task_id, reason="rejected"),
    )
    for attempt in attempts:
        with pytest.raises(MessageRefused) as refused:
            attempt()
        assert refused.value.reason == executions.TASK_ID_UNRECORDABLE
    # Then nothing was written, on either database, and each refusal is counted
    assert list(Execution.objects.values_list("pk", flat=True)) == [execution.pk]
    assert row_state(execution.pk) == before
    assert refused_counts()[executions.TASK_ID_UNRECORDABLE] == 5.0


def test_longest_recordable_task_id__recorded_and_claimed() -> None:
    # Given a plain call whose task id is as long as a row can hold
    task_id = "z" * executions.MAX_TASK_ID_LENGTH
    call = {"task": TASK, "args": [], "kwargs": {}, "queue": "", "timeout": None, "now": dbclock.now()}
    # When its worker records it claimed
    claimed = executions.record_ad_hoc_claimed(task_id, worker="a@host:2", **call)
    # Then it is, under its whole id
    assert claimed is not None and Execution.objects.get().celery_task_id == task_id


#: ``execution_id`` headers no sender writes: the senders write a row's id, a whole number.
MALFORMED_HEADERS = ["12", "", [1], {"id": 1}, True, 1.5, 0, -1, 2**63]


@pytest.mark.parametrize("header", MALFORMED_HEADERS, ids=repr)
def test_malformed_execution_id_header__refused_and_counted(header: Any) -> None:
    # Given tenant B's queued execution, id 1 or more
    execution = recorded()
    before = row_state(execution.pk)
    # When a message's header is no execution id
    with pytest.raises(MessageRefused) as refused:
        executions.execution_id_of(header, task=TASK, celery_task_id=execution.celery_task_id)
    # Then it is refused for that, counted, nothing written
    assert refused.value.reason == executions.EXECUTION_ID_INVALID
    assert refused_counts()[executions.EXECUTION_ID_INVALID] == 1.0
    assert row_state(execution.pk) == before

"""A real worker runs a message against an execution only if the message was sent for it (guarantee 13).

Tenant B has a queued execution of ``tests.record`` with its own Celery task
id. Messages that name B's execution id in their header but carry another
task name, or B's task name under another task id, are refused by the
worker: acknowledged, not run, logged and counted, and B's row is left as
it was. A message of a task the worker does not know cannot fail B's
execution, and ``celery.group`` cannot smuggle such a message in either.
B's own message, published the way the beat publishes it, then runs once.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import signature
from django.test import Client

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, schedules
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
HEADER = Execution.MESSAGE_HEADER
REFUSED = re.compile(r"^scheduler_messages_refused_total\{reason=\"(\w+)\"\} (\S+)$", re.MULTILINE)


def queued_for_tenant_b() -> Execution:
    """Record one slot of tenant B's schedule and mark it sent; its message is still on its way."""
    schedule = Schedule(name="b-report", task="tests.record", kwargs={"label": "b"}, interval=3600, tenant="b")
    schedule.full_clean()
    schedules.save(schedule, now=dbclock.now())
    now = dbclock.now()
    [row] = executions.record_slots(schedule, [(now, Execution.Status.PENDING)], now=now)
    assert executions.mark_queued([row["id"]], now=now) == 1
    execution = Execution.objects.get(pk=row["id"])
    assert execution.celery_task_id and execution.status == Execution.Status.QUEUED
    return execution


def b_queued_and_a_worker(celery_processes: Start) -> tuple[Execution, dict[str, Any], CeleryProcess]:
    """Return B's queued execution, its row as it is before any message, and a worker ready for messages."""
    b = queued_for_tenant_b()
    before = row_state(b)
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    return b, before, worker


def row_state(execution: Execution) -> dict[str, Any]:
    return Execution.objects.filter(pk=execution.pk).values().get()


def refusals_logged(worker: CeleryProcess) -> list[str]:
    return [line for line in worker.log().splitlines() if "refused for execution" in line]


def refused_counts() -> dict[str, float]:
    """Scrape ``/metrics`` as Prometheus would; return the refused-message counter by reason."""
    response = Client().get("/metrics")
    assert response.status_code == 200
    return {reason: float(value) for reason, value in REFUSED.findall(response.content.decode())}


def wait_final(execution: Execution, *, timeout: float = 30.0) -> Execution:
    done = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status__in=Execution.FINAL_STATUSES).first(), timeout=timeout
    )
    assert done, f"execution {execution.pk} never finished: {row_state(execution)}"
    return done  # type: ignore[return-value]


def publish_as_the_beat_does(execution: Execution) -> None:
    outbox.publish(app, [executions.message_row(execution)], now=dbclock.now())


def b_runs_once_from_its_own_message(b: Execution, redis_client: redis.Redis) -> Execution:
    """Publish B's own message as the beat does; assert B's body ran once, as its first attempt, and succeeded."""
    publish_as_the_beat_does(b)
    done = wait_final(b)
    assert (done.status, done.attempt, done.result) == (Execution.Status.SUCCEEDED, 1, "b")
    assert [(run["execution_id"], run["label"]) for run in test_tasks.runs(redis_client)] == [(b.pk, "b")]
    return done


def test_messages_not_sent_for_the_execution__refused_then_its_own_runs_once(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given tenant B's queued execution and a worker
    b, before, worker = b_queued_and_a_worker(celery_processes)
    # When a message names B's execution with another task name (under B's own task id)
    app.send_task("tests.steps", args=[1, 0.0], task_id=b.celery_task_id, headers={HEADER: b.pk})
    # And another names it with B's task name under another task id
    intruder = str(uuid.uuid4())
    app.send_task("tests.record", kwargs={"label": "intruder"}, task_id=intruder, headers={HEADER: b.pk})
    # Then the worker refuses both: logged with both sides' ids, counted, nothing ran, B's row untouched
    assert wait_until(lambda: len(refusals_logged(worker)) == 2, timeout=20), worker.log()[-3000:]
    first, second = sorted(refusals_logged(worker), key=lambda line: "tests.steps" not in line)
    assert f"message {b.celery_task_id} (task tests.steps) refused for execution {b.pk} " in first
    assert f"(task tests.record, celery id {b.celery_task_id}): task_mismatch" in first
    assert f"message {intruder} (task tests.record) refused for execution {b.pk} " in second
    assert f"(task tests.record, celery id {b.celery_task_id}): task_id_mismatch" in second
    assert refused_counts() == {
        "task_mismatch": 1.0,
        "task_id_mismatch": 1.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }
    assert test_tasks.runs(redis_client) == [] and test_tasks.events(redis_client, test_tasks.STEPS_KEY) == []
    assert row_state(b) == before
    # When B's own message is published the way the beat publishes it
    # Then B's body runs exactly once, as B's first attempt, and the row ends succeeded
    done = b_runs_once_from_its_own_message(b, redis_client)
    assert done.celery_task_id == b.celery_task_id
    assert len(refusals_logged(worker)) == 2


def test_message_of_an_unknown_task_naming_b__does_not_fail_b(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given tenant B's queued execution and a worker
    b, before, worker = b_queued_and_a_worker(celery_processes)
    # When a message of a task no worker knows names B's execution (the worker rejects it)
    app.send_task("no.such.task", task_id=b.celery_task_id, headers={HEADER: b.pk})
    # Then the rejection does not fail B: refused, logged and counted, the row untouched
    worker.wait_for_log(r"Received unregistered task of type 'no\.such\.task'")
    assert wait_until(lambda: len(refusals_logged(worker)) == 1, timeout=20), worker.log()[-3000:]
    assert refusals_logged(worker)[0].endswith(": task_mismatch; not failed")
    assert refused_counts() == {
        "task_mismatch": 1.0,
        "task_id_mismatch": 0.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }
    assert row_state(b) == before
    # And B's own message still runs it once
    b_runs_once_from_its_own_message(b, redis_client)


def test_celery_group_carrying_a_message_for_b__runs_nothing_against_b(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given tenant B's queued execution and a worker
    b, before, worker = b_queued_and_a_worker(celery_processes)
    # When a celery.group runs whose argument is a whole message for B's execution: B's task, B's header
    inner_id, group_id = str(uuid.uuid4()), str(uuid.uuid4())
    smuggled = signature("tests.record", kwargs={"label": "hijack"}, task_id=inner_id, headers={HEADER: b.pk})
    results = [[group_id, None], [[[inner_id, None], None]]]
    group = app.send_task("celery.group", args=[[dict(smuggled)], results, group_id, []])
    # Then the group's own execution ran, and the message it sent was refused
    assert wait_until(
        lambda: Execution.objects.filter(
            idempotency_key=executions.ad_hoc_key(group.id), status__in=Execution.FINAL_STATUSES
        ).exists(),
        timeout=20,
    ), worker.log()[-3000:]
    assert wait_until(lambda: len(refusals_logged(worker)) == 1, timeout=20), worker.log()[-3000:]
    assert f"message {inner_id} (task tests.record) refused for execution {b.pk} " in refusals_logged(worker)[0]
    assert refused_counts() == {
        "task_mismatch": 0.0,
        "task_id_mismatch": 1.0,
        "task_id_unrecordable": 0.0,
        "execution_id_invalid": 0.0,
    }
    # And nothing ran against B's row
    assert test_tasks.runs(redis_client) == []
    assert row_state(b) == before
    # When B's own message comes, B runs once
    b_runs_once_from_its_own_message(b, redis_client)


def test_plain_calls_with_task_ids_no_row_can_hold__refused_in_one_line_and_the_next_runs(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given a worker
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When plain Celery calls arrive with a task id holding a NUL character,
    # and one too long for a row, then an ordinary one
    for odd in ("a\x00b", "z" * (executions.MAX_TASK_ID_LENGTH + 1)):
        app.send_task("tests.record", kwargs={"label": "odd"}, task_id=odd)
    fine = app.send_task("tests.record", kwargs={"label": "fine"})
    # Then the ordinary one runs, and only it
    assert wait_until(lambda: test_tasks.runs(redis_client), timeout=20), worker.log()[-3000:]
    assert wait_until(lambda: worker.log().count("task_id_unrecordable; acknowledged, not run") == 2, timeout=10), (
        worker.log()[-3000:]
    )
    assert [run["task_id"] for run in test_tasks.runs(redis_client)] == [fine.id]
    # the others refused with one line each, no traceback, nothing recorded for them
    assert "Traceback" not in worker.log()
    assert list(Execution.objects.values_list("celery_task_id", flat=True)) == [fine.id]


def test_messages_whose_header_is_no_execution_id__refused_in_one_line_and_the_fast_path_kept(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given tenant B's queued execution (id 1 or more) and a worker
    b, before, worker = b_queued_and_a_worker(celery_processes)
    # When messages of B's task name its execution by headers no sender writes
    # (1.5 and True would otherwise be read as execution 1)
    malformed = ["abc", "", [1], {"id": 1}, True, 1.5, 0, 2**63]
    for header in malformed:
        app.send_task("tests.record", kwargs={"label": "odd"}, task_id=b.celery_task_id, headers={HEADER: header})
    fine = app.send_task("tests.record", kwargs={"label": "fine"})
    # Then each is refused in one line, nothing runs but the ordinary call
    assert wait_until(
        lambda: worker.log().count("execution_id_invalid; acknowledged, not run") == len(malformed), timeout=20
    ), worker.log()[-3000:]
    assert wait_until(lambda: test_tasks.runs(redis_client), timeout=20), worker.log()[-3000:]
    assert [run["task_id"] for run in test_tasks.runs(redis_client)] == [fine.id]
    assert "Traceback" not in worker.log()
    # B's row is as it was, the refusals are counted, and the worker kept its fast path
    assert row_state(b) == before
    assert refused_counts()["execution_id_invalid"] == len(malformed)
    assert "falls back" not in worker.log()

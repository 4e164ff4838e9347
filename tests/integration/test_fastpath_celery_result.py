"""Celery's result row written by the guard's outcome statement (``scheduler.fastpath.celery_result``).

Each test runs a guarded task in this process as a worker's pool child does
(Celery's tracer, not eager), once with the fast path and once with Celery
storing the result itself, and compares the rows the two leave.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import shared_task
from celery.app.trace import build_tracer
from celery.backends.base import DisabledBackend
from django.db import DatabaseError, connection, connections
from django.test.utils import CaptureQueriesContext
from django_celery_results.models import TaskResult

from project.celery import app
from scheduler import dbclock
from scheduler.fastpath import celery_result
from scheduler.fastpath.guard import FastPath
from scheduler.models import Execution
from scheduler.owners import executions
from tests.integration.fastpath_support import fallback_warnings, fallbacks_counted, fresh
from tests.support import factories

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "tests.integration.fastpath_result"
#: What a row holds that differs between two runs of the same call.
PER_RUN = {"id", "task_id", "date_created", "date_done"}


@shared_task(name=TASK)
def add(a: int, b: int, *, note: str = "") -> dict[str, Any]:
    return {"sum": a + b, "note": note}


TAKEN_OVER = "tests.integration.fastpath_result_taken_over"


@shared_task(name=TAKEN_OVER)
def taken_over(task_id: str, *, fail: bool) -> str:
    """A body whose claim another worker takes over while it runs (its own ran out): then it returns or raises."""
    Execution.objects.filter(celery_task_id=task_id).update(claim_expires_at=dbclock.now() - timedelta(seconds=1))
    successor = executions.claim(worker="successor@host:2", task=TAKEN_OVER, celery_task_id=task_id, key=task_id)
    assert successor is not None and successor.attempt == 2
    if fail:
        raise RuntimeError("the first attempt fails late")
    return "the first attempt's value"


@pytest.fixture(autouse=True)
def no_background_renewal(settings: Any) -> None:
    # The guard's renewer thread would open its own connection in this process.
    settings.SCHEDULER_CLAIM_RENEW_SECONDS = 3600


@pytest.fixture
def fast_path(monkeypatch: pytest.MonkeyPatch) -> FastPath:
    return fresh(monkeypatch, celery_result)


def pool_message(task_id: str, task: str, execution_id: int | None = None, **request: Any) -> dict[str, Any]:
    """The request a pool child runs ``task_id`` with; naming ``execution_id`` when one was recorded for it."""
    return {
        "id": task_id,
        "task": task,
        "hostname": "pool@test-host",
        "headers": {} if execution_id is None else {Execution.MESSAGE_HEADER: execution_id},
        "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0, "redelivered": False},
        "is_eager": False,
        **request,
    }


def scheduled_execution(task_id: str) -> Execution:
    """A queued execution of ``TASK`` recorded for a schedule, sent as ``task_id``."""
    schedule = factories.make_schedule(f"every-{task_id}", task=TASK)
    return factories.make_execution(
        task_id, schedule=schedule, status=Execution.Status.QUEUED, celery_task_id=task_id, task=TASK
    )


def run_in_worker(*, recorded: bool = False, task_id: str | None = None, **request: Any) -> str:
    """Run ``add(2, 3, note="x")`` as a pool child runs a message; with ``recorded``, of a scheduled execution."""
    task_id = task_id or str(uuid.uuid4())
    execution_id = scheduled_execution(task_id).pk if recorded else None
    message = pool_message(task_id, TASK, execution_id, argsrepr="(2, 3)", kwargsrepr="{'note': 'x'}", **request)
    tracer = build_tracer(TASK, add, app=app, eager=False, propagate=True)
    tracer(task_id, (2, 3), {"note": "x"}, message)
    return task_id


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_attempt_whose_claim_moved_on__leaves_the_result_row_to_the_attempt_holding_it(
    fast_path: FastPath, fail: bool
) -> None:
    # Given a recorded execution whose first attempt's claim the second takes over while its body runs
    task_id = str(uuid.uuid4())
    recorded = factories.make_execution(
        task_id, status=Execution.Status.QUEUED, celery_task_id=task_id, task=TAKEN_OVER
    )
    tracer = build_tracer(TAKEN_OVER, taken_over, app=app, eager=False, propagate=False)

    # When the first attempt's body returns, or raises, after that
    tracer(task_id, (task_id,), {"fail": fail}, pool_message(task_id, TAKEN_OVER, recorded.pk))

    # Then the execution is the second attempt's, still running, and no result row speaks for the first
    execution = Execution.objects.get(celery_task_id=task_id)
    assert (execution.status, execution.attempt) == (Execution.Status.RUNNING, 2)
    assert not TaskResult.objects.filter(task_id=task_id).exists()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL only: a server that ends an idle session")
@pytest.mark.parametrize("moved_on", [False, True], ids=["claim-held", "claim-moved-on"])
def test_outcome_write_cut_off_by_the_server__written_again_or_no_result_stored(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, moved_on: bool
) -> None:
    # Given a scheduled execution whose body succeeds, and a server that ends the session while
    # the outcome's transaction waits (its idle-in-transaction timeout), the claim maybe moving on meanwhile
    task_id = str(uuid.uuid4())
    recorded = scheduled_execution(task_id)
    successor = connections.create_connection("default")
    cut = []

    def cut_off(name: str) -> None:
        if name != "outcome.in_transaction" or cut:
            return
        cut.append(name)
        with connection.cursor() as cursor:
            cursor.execute("SET idle_in_transaction_session_timeout = 50")
        time.sleep(0.5)
        if moved_on:  # a second attempt claims it elsewhere meanwhile
            with successor.cursor() as cursor:
                cursor.execute(
                    "UPDATE scheduler_execution SET attempt = 2, worker = 'successor@host:2' WHERE id = %s",
                    [recorded.pk],
                )

    monkeypatch.setattr(executions, "failpoint", cut_off)

    # When the first attempt's body returns and its outcome is written
    try:
        build_tracer(TASK, add, app=app, eager=False, propagate=False)(
            task_id, (2, 3), {}, pool_message(task_id, TASK, recorded.pk)
        )
    finally:
        successor.close()

    # Then the session was cut, and the outcome written again on a new one: the first attempt's success,
    # with its result; or, the claim having moved on, nothing, and no result over the second attempt's
    assert cut
    execution = Execution.objects.get(pk=recorded.pk)
    results = list(TaskResult.objects.filter(task_id=task_id).values_list("status", flat=True))
    if moved_on:
        assert (execution.status, execution.attempt, results) == (Execution.Status.RUNNING, 2, [])
    else:
        assert (execution.status, execution.attempt, results) == (Execution.Status.SUCCEEDED, 1, ["SUCCESS"])


def test_outcome_write_that_fails__stores_no_result_over_the_attempt_to_come(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a scheduled execution whose body succeeds, and an outcome write that fails inside its
    # transaction with an error that is not a lost connection (a statement timeout, say)
    task_id = str(uuid.uuid4())
    recorded = scheduled_execution(task_id)

    def fail(name: str) -> None:
        if name == "outcome.in_transaction":
            raise DatabaseError("canceling statement due to statement timeout")

    monkeypatch.setattr(executions, "failpoint", fail)

    # When the first attempt's body returns and its outcome is written
    build_tracer(TASK, add, app=app, eager=False, propagate=False)(
        task_id, (2, 3), {}, pool_message(task_id, TASK, recorded.pk)
    )

    # Then nothing was recorded: the attempt's claim runs out and the execution runs again, and the
    # task id's result is left to that attempt, not stored as this one's FAILURE
    execution = Execution.objects.get(pk=recorded.pk)
    assert (execution.status, execution.attempt) == (Execution.Status.RUNNING, 1)
    assert not TaskResult.objects.filter(task_id=task_id).exists(), row(task_id)


def row(task_id: str) -> dict[str, Any]:
    return TaskResult.objects.filter(task_id=task_id).values().get()


def alike(row: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in row.items() if name not in PER_RUN}


def writes_of_results(queries: CaptureQueriesContext) -> list[str]:
    table = TaskResult._meta.db_table
    return [query["sql"] for query in queries.captured_queries if table in query["sql"]]


@pytest.mark.parametrize("recorded", [False, True], ids=["ad-hoc", "scheduled"])
def test_success__the_outcome_statement_writes_the_row_celery_writes(fast_path: FastPath, recorded: bool) -> None:
    # Given the same call run once with the fast path (its self-check done) and once with Celery storing it itself
    run_in_worker()
    with CaptureQueriesContext(connection) as queries:
        fast = run_in_worker(recorded=recorded)
    fast_path.fall_back("the slow path, for comparison")
    slow = run_in_worker(recorded=recorded)

    # Then both rows hold the same values, and the execution succeeded with the call's result
    assert alike(row(fast)) == alike(row(slow))
    assert row(fast)["status"] == "SUCCESS" and row(fast)["worker"] == "pool@test-host"
    assert app.AsyncResult(fast).get(timeout=1) == {"sum": 5, "note": "x"}
    finished = Execution.objects.get(celery_task_id=fast)
    assert finished.status == Execution.Status.SUCCEEDED
    # And the fast run wrote the row by one statement and never read it first (Celery's get_or_create does)
    written = writes_of_results(queries)
    assert len(written) == 1 and written[0].lstrip().upper().startswith(
        "WITH" if connection.vendor == "postgresql" else "INSERT"
    ), written


def test_success__a_row_started_already_keeps_its_start_and_creation(fast_path: FastPath) -> None:
    # Given a row Celery wrote when the task started (track_started)
    task_id = str(uuid.uuid4())
    started = dbclock.now()
    TaskResult.objects.create(task_id=task_id, status="STARTED", date_started=started)
    created = row(task_id)["date_created"]

    # When the task succeeds under that id
    run_in_worker(task_id=task_id)

    # Then the row is saved again as the manager saves it: a success, started and created when it was
    saved = row(task_id)
    assert saved["status"] == "SUCCESS" and saved["date_started"] == started and saved["date_created"] == created


@pytest.mark.parametrize(
    "request_fields",
    [
        {"callbacks": [add.s(1)]},
        {"ignore_result": True},
    ],
    ids=["with a callback", "ignoring its result"],
)
def test_requests_celery_stores_otherwise_are_left_to_it(fast_path: FastPath, request_fields: dict[str, Any]) -> None:
    # Given a success whose result Celery stores after its callbacks (children) or not at all
    with CaptureQueriesContext(connection) as queries:
        task_id = run_in_worker(**request_fields)

    # Then the outcome statement wrote no result row: Celery did as it always does
    assert not any(sql.lstrip().upper().startswith("WITH") for sql in writes_of_results(queries))
    assert TaskResult.objects.filter(task_id=task_id).exists() is not bool(request_fields.get("ignore_result"))
    assert not fast_path.fallen


def test_another_result_backend__is_left_to_celery_without_a_fallback(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task whose results go elsewhere than django-celery-results' table
    monkeypatch.setattr(add, "_backend", DisabledBackend(app))

    # When it succeeds
    task_id = run_in_worker()

    # Then the execution is recorded, no result row is written, and the fast path stays (it was never its case)
    assert Execution.objects.get(celery_task_id=task_id).status == Execution.Status.SUCCEEDED
    assert not TaskResult.objects.filter(task_id=task_id).exists() and not fast_path.fallen


def test_backend_asking_to_store_other_fields__falls_back_and_celery_stores(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a backend that hands the manager a field the statement does not write (an upgrade added one)
    monkeypatch.setattr(celery_result, "STORED", tuple(name for name in celery_result.STORED if name != "worker"))
    counted = fallbacks_counted("celery_result")

    # When a guarded task succeeds
    task_id = run_in_worker()

    # Then the process falls back, says so once, and the row is Celery's own
    assert fast_path.fallen and len(fallback_warnings(caplog)) == 1
    assert fallbacks_counted("celery_result") == counted + 1
    assert row(task_id)["worker"] == "pool@test-host" and row(task_id)["status"] == "SUCCESS"


def test_row_written_otherwise_than_asked__is_stored_again_by_the_manager_and_falls_back(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a statement that writes another value than the row asks for (as a changed column would)
    params = celery_result.params
    monkeypatch.setattr(celery_result, "params", lambda row: {**params(row), "celery_worker": "someone@else"})

    # When a guarded task succeeds, and another after it
    first = run_in_worker()
    second = run_in_worker()

    # Then the self-check finds the difference, the row is stored again right, and the next is Celery's own
    assert fast_path.fallen and len(fallback_warnings(caplog)) == 1
    assert row(first)["worker"] == row(second)["worker"] == "pool@test-host"


def test_text_longer_than_its_column__left_to_celery_without_a_fallback(fast_path: FastPath) -> None:
    # Given a worker whose name is longer than the result row's column holds (django-celery-results: 100)
    hostname = "pool@" + "h" * 200
    # When a guarded task succeeds on it
    with CaptureQueriesContext(connection) as queries:
        try:
            task_id = run_in_worker(hostname=hostname)
        except Exception as error:  # noqa: BLE001 -- PostgreSQL refuses the text where Celery stores it
            assert "too long" in str(error), error
            task_id = Execution.objects.get().celery_task_id

    # Then the success is recorded, and the result row was left to Celery's store (its get_or_create reads first)
    assert Execution.objects.get(celery_task_id=task_id).status == Execution.Status.SUCCEEDED
    assert any(sql.lstrip().upper().startswith("SELECT") for sql in writes_of_results(queries))
    stored = TaskResult.objects.filter(task_id=task_id).values_list("worker", flat=True)
    assert list(stored) == ([] if connection.vendor == "postgresql" else [hostname])
    assert not fast_path.fallen

"""The worker's per-task statements, compiled once per process (``scheduler.fastpath.prepared``), write what the ORM writes.

A Django internal changed under them compiles each statement per call, with one warning and one count.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.sql.compiler import SQLUpdateCompiler

from scheduler import dbclock
from scheduler.fastpath import prepared
from scheduler.fastpath.guard import FastPath
from scheduler.models import Execution
from scheduler.owners import executions
from scheduler.owners.executions import Claim
from tests.integration.fastpath_support import fallback_warnings, fallbacks_counted, fresh

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


@pytest.fixture(autouse=True)
def fast_path(monkeypatch: pytest.MonkeyPatch) -> FastPath:
    """The worker's statements as a new process has them: not compiled, not checked."""
    for statement in (executions._CLAIM, executions._FINISH, executions._RESULT, executions._AD_HOC):
        monkeypatch.setattr(statement, "_compiled", {})
    monkeypatch.setattr(executions._ROW, "_checked", set())
    return fresh(monkeypatch, prepared)


#: Every column but those that differ between two rows by design.
COMPARED = [
    field.attname
    for field in Execution._meta.concrete_fields
    if field.attname not in ("id", "idempotency_key", "created_at", "started_at", "finished_at", "claim_expires_at")
]


def queued(*keys: str) -> None:
    now = dbclock.now()
    for key in keys:
        Execution.objects.create(
            idempotency_key=key, task="scheduler.echo", scheduled_for=now, celery_task_id="celery-1"
        )


def claimed(key: str) -> Claim:
    execution = executions.claim(worker="w@host:1", task="scheduler.echo", celery_task_id="celery-1", key=key)
    assert execution is not None
    return Claim.of(execution)


def columns(key: str) -> dict[str, Any]:
    return Execution.objects.filter(idempotency_key=key).values(*COMPARED).get()


@pytest.mark.parametrize("result", [None, {"rows": [1, 2]}, ["a"], "text", 0, False])
@pytest.mark.parametrize("status", [Status.SUCCEEDED, Status.FAILED, Status.TIMED_OUT])
def test_finish__writes_the_row_the_orm_update_writes(status: str, result: Any, fast_path: FastPath) -> None:
    # Given two running executions, one finished by the worker's statement, one by the ORM's update
    queued("prepared", "orm")
    held, other = claimed("prepared"), claimed("orm")
    # When both record the same outcome
    assert executions.finish(held, status=status, result=result, error="boom", traceback_text="tb")
    assert executions._finish_rows(other.rows(), status, result, "boom", "tb") == 1
    # Then the rows are alike, a None result included (SQL NULL, not JSON null)
    assert columns("prepared") == columns("orm")
    assert Execution.objects.filter(result__isnull=True).count() == (2 if result is None else 0)
    # by statements compiled once, which the self-check found alike the ORM's
    assert not fast_path.fallen


def test_finish__by_a_superseded_attempt_writes_nothing() -> None:
    # Given an execution taken over by attempt 2 after attempt 1's claim ran out
    queued("e")
    stale = claimed("e")
    Execution.objects.filter(idempotency_key="e").update(claim_expires_at=dbclock.now() - timedelta(seconds=5))
    current = claimed("e")
    # When attempt 1 records its outcome and its result
    finished = executions.finish(stale, status=Status.SUCCEEDED, result="stale")
    stored = executions.record_result(stale, "stale")
    # Then neither lands; attempt 2 still runs
    assert (finished, stored) == (False, False)
    assert Execution.objects.values_list("status", "attempt", "result").get() == (Status.RUNNING, current.attempt, None)


def test_claim__follows_a_changed_claim_length(settings: Any) -> None:
    # Given a claim made with one claim length (the statement is compiled with it)
    settings.SCHEDULER_CLAIM_SECONDS = 60
    queued("short", "long")
    claimed("short")
    # When the setting changes and another execution is claimed
    settings.SCHEDULER_CLAIM_SECONDS = 3600
    claimed("long")
    # Then each claim lasts as long as the setting said when it was made
    lengths = {
        key: round((expires - started).total_seconds())
        for key, started, expires in Execution.objects.values_list("idempotency_key", "started_at", "claim_expires_at")
    }
    assert lengths == {"short": 60, "long": 3600}


def test_record_ad_hoc__writes_the_row_insert_writes_once() -> None:
    # Given a plain Celery call recorded by the worker, and the same row inserted by executions.insert
    now = dbclock.now()
    call = {"task": "scheduler.echo", "args": (1, "a"), "kwargs": {"k": [1]}, "queue": "q", "timeout": 30, "now": now}
    key = executions.record_ad_hoc("celery-1", **call)
    executions.insert(
        [
            Execution(
                idempotency_key="orm",
                trigger=Execution.Trigger.SUBMIT,
                task="scheduler.echo",
                args=[1, "a"],
                kwargs={"k": [1]},
                queue="q",
                scheduled_for=now,
                status=Status.QUEUED,
                celery_task_id="celery-1",
                timeout=30,
            )
        ]
    )
    # When the same message is recorded again (a redelivery)
    assert executions.record_ad_hoc("celery-1", **call) == key
    # Then there is one row for it, alike the inserted one, stamped with its creation time
    assert Execution.objects.filter(idempotency_key=key).count() == 1
    assert {**columns(key), "enqueued_at": None} == columns("orm")
    recorded = Execution.objects.get(idempotency_key=key)
    assert recorded.created_at is not None
    # and queued since then, on the database's clock (a queued row says since when it waits)
    assert now <= recorded.enqueued_at <= dbclock.now()


def test_compiler_changed__self_check_compiles_per_call(
    fast_path: FastPath, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Given a Django whose UPDATE compiler no longer hands an expression's parameters on as they are
    original = SQLUpdateCompiler.as_sql

    def as_sql(compiler: SQLUpdateCompiler) -> tuple[str, tuple[Any, ...]]:
        sql, params = original(compiler)
        return sql, tuple(repr(param) if isinstance(param, prepared.Param) else param for param in params)

    monkeypatch.setattr(SQLUpdateCompiler, "as_sql", as_sql)
    queued("prepared", "orm")
    # When a worker claims and finishes one execution, and the ORM the other
    held, other = claimed("prepared"), claimed("orm")
    assert executions.finish(held, status=Status.SUCCEEDED, result={"rows": [1]}, error="", traceback_text="")
    assert executions._finish_rows(other.rows(), Status.SUCCEEDED, {"rows": [1]}, "", "") == 1
    # Then the self-check found the difference before the claim ran: both ran compiled per call, alike
    assert fast_path.fallen
    assert held.attempt == other.attempt == 1
    assert columns("prepared") == columns("orm")
    # and the fallback was logged once and counted once
    [warning] = fallback_warnings(caplog)
    assert "Param" in warning.getMessage()
    assert fallbacks_counted("prepared") == 1


@pytest.mark.parametrize("execution_id", [[1], "abc"], ids=repr)
def test_a_value_no_statement_takes__raises_the_inputs_error_and_keeps_the_fast_path(
    execution_id: Any, fast_path: FastPath, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a claim statement compiled and checked
    queued("k")
    claimed("k")
    # When a caller passes an id that is no number
    with pytest.raises((TypeError, ValueError)):
        executions.claim(worker="w@host:1", task="scheduler.echo", celery_task_id="celery-1", execution_id=execution_id)
    # Then the error is the value's (compiled per call, it fails alike), and the fast path stays taken
    assert not fast_path.fallen and not fallback_warnings(caplog)

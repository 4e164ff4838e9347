"""On PostgreSQL the worker's claim and outcome run as prepared statements (``scheduler.fastpath.cursors``).

Planned once per connection; not at all with ``SCHEDULER_PREPARED_STATEMENTS
= False``; and a session that lost them, as behind a transaction pooler,
runs the statement unnamed and stops preparing, with one warning and one count.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from scheduler import dbclock
from scheduler.fastpath import cursors
from scheduler.fastpath.guard import FastPath
from scheduler.models import Execution
from scheduler.owners import executions
from scheduler.owners.executions import Claim
from tests.integration.fastpath_support import fallback_warnings, fallbacks_counted, fresh

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="PostgreSQL only: SQLite has no prepared statements kept by a server session",
    ),
]

Status = Execution.Status


@pytest.fixture(autouse=True)
def fast_path(monkeypatch: pytest.MonkeyPatch) -> FastPath:
    """A new process's state: a new database session, with nothing prepared, and preparing not fallen back from."""
    connection.close()
    return fresh(monkeypatch, cursors)


def run_one(key: str) -> None:
    """Record an execution, claim it and record its success, as the worker's guard does."""
    Execution.objects.create(
        idempotency_key=key, task="scheduler.echo", scheduled_for=dbclock.now(), celery_task_id=f"celery-{key}"
    )
    execution = executions.claim(worker="w@host:1", task="scheduler.echo", celery_task_id=f"celery-{key}", key=key)
    assert execution is not None
    assert executions.finish(Claim.of(execution), status=Status.SUCCEEDED, result={"key": key})


def prepared() -> dict[str, str]:
    """The session's prepared statements on the execution table: {name: statement}."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, statement FROM pg_prepared_statements WHERE statement LIKE %s", ["%scheduler_execution%"]
        )
        return dict(cursor.fetchall())


def succeeded(*keys: str) -> bool:
    return Execution.objects.filter(idempotency_key__in=keys, status=Status.SUCCEEDED).count() == len(keys)


def test_claim_and_outcome__prepared_once_per_session_and_run_again_by_name() -> None:
    # When a worker's session runs two executions
    run_one("a")
    first = prepared()
    run_one("b")
    # Then the claim and the outcome were prepared by the first, and the second ran the same ones
    assert len(first) == 2, first
    assert any(statement.lstrip().startswith("UPDATE") and "RETURNING" in statement for statement in first.values())
    assert prepared() == first
    assert succeeded("a", "b")


def test_setting_off__nothing_is_prepared(settings: Any) -> None:
    # Given prepared statements turned off (a transaction pooler between)
    settings.SCHEDULER_PREPARED_STATEMENTS = False
    # When a worker's session runs two executions
    run_one("a")
    run_one("b")
    # Then every statement ran unnamed
    assert prepared() == {}
    assert succeeded("a", "b")


def test_session_lost_them__the_statement_runs_unnamed_and_preparing_stops(
    fast_path: FastPath, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a session whose prepared statements are gone, as when a pooler hands the next
    # transaction to another server session
    run_one("a")
    with connection.cursor() as cursor:
        for name in prepared():
            cursor.execute(f'DEALLOCATE "{name}"')
    # When the next executions are claimed and finished
    run_one("b")
    run_one("c")
    # Then both ran, the statement that met the lost one run again unnamed
    assert succeeded("a", "b", "c")
    # and nothing was prepared again
    assert fast_path.fallen
    assert prepared() == {}
    # and the fallback was logged once and counted once
    [warning] = fallback_warnings(caplog)
    assert "prepared_statements" in warning.getMessage()
    assert fallbacks_counted("prepared_statements") == 1


def test_session_lost_them_inside_a_transaction__its_error_propagates_and_the_transaction_rolls_back(
    fast_path: FastPath,
) -> None:
    # Given a session whose prepared statements are gone
    run_one("a")
    Execution.objects.create(
        idempotency_key="b", task="scheduler.echo", scheduled_for=dbclock.now(), celery_task_id="celery-b"
    )
    with connection.cursor() as cursor:
        for name in prepared():
            cursor.execute(f'DEALLOCATE "{name}"')
    # When a claim meets it inside a transaction
    with pytest.raises(DatabaseError), transaction.atomic():
        executions.claim(worker="w@host:1", task="scheduler.echo", celery_task_id="celery-b", key="b")
    # Then nothing was written, and the next claim, outside, runs unnamed
    assert Execution.objects.get(idempotency_key="b").status == Status.PENDING
    assert fast_path.fallen
    assert executions.claim(worker="w@host:1", task="scheduler.echo", celery_task_id="celery-b", key="b") is not None


def test_queries_logged__run_unnamed_so_the_log_has_their_text() -> None:
    # When Django logs the queries of a session (DEBUG, a test capturing them) that runs an execution
    with CaptureQueriesContext(connection) as queries:
        run_one("a")
    # Then nothing was prepared, and every statement logged has its text
    assert prepared() == {}
    assert queries.captured_queries and all(query["sql"] for query in queries.captured_queries)

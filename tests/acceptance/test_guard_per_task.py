"""The execution guard per task (``base=ExecutionTask``) or process-wide (``task_cls``), and a task's opt-out (``guarded=False``).

Real workers: one of an app that guards nothing by default
(``tests.support.plain_celery``), one of the demo project (every task guarded).
Messages are sent the plain Celery way (``.delay()``) and through
``scheduler.submit()``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import scheduler
from scheduler import dbclock, outbox
from scheduler.celery_app import celery_app
from scheduler.models import Execution
from scheduler.owners import executions
from scheduler.owners.executions import ad_hoc_key
from tests.support import guard_tasks
from tests.support.processes import ROOT, CeleryProcess, wait_until, worker_argv

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def bodies(redis_client: redis.Redis) -> Callable[[], list[str]]:
    redis_client.delete(guard_tasks.BODIES_KEY)
    return lambda: sorted(item.decode() for item in redis_client.lrange(guard_tasks.BODIES_KEY, 0, -1))


@pytest.fixture
def worker_of(process_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[str], CeleryProcess]]:
    """Start a worker of the Celery app ``-A`` names, with this module's tasks; stopped afterwards."""
    started: list[CeleryProcess] = []

    def start(app: str) -> CeleryProcess:
        argv = worker_argv(app.replace(".", "-"))
        argv[argv.index("project")] = app
        argv[argv.index("tests.support.tasks")] = "tests.support.tasks,tests.support.guard_tasks"
        process = CeleryProcess(app, argv, process_env, tmp_path / f"{app}.log", cwd=ROOT).start()
        started.append(process)
        process.wait_for_log(r"ready\.", timeout=60)
        return process

    yield start
    for process in started:
        process.stop()


def _status(key: str) -> str | None:
    return Execution.objects.filter(idempotency_key=key).values_list("status", flat=True).first()


def test_per_task_guard__on_an_app_without_it__only_that_task_is_recorded(
    worker_of: Callable[[str], CeleryProcess], bodies: Callable[[], list[str]]
) -> None:
    # Given: a worker of an app that guards nothing by default
    plain_worker = worker_of("tests.support.plain_celery")

    # When: a guarded task and a plain one are sent the plain way, and the guarded one submitted
    guarded = guard_tasks.per_task.delay("a")
    unguarded = guard_tasks.plain.delay("b")
    submitted = scheduler.submit("tests.guard.per_task", args=["c"], idempotency_key="per-task-c")

    # Then: all three bodies run
    assert wait_until(lambda: len(bodies()) == 3, timeout=30), (bodies(), plain_worker.log()[-2000:])
    assert bodies() == ["per_task:a", "per_task:c", "plain:b"]
    # And the guarded ones are recorded, succeeded; the plain one is not recorded at all
    assert wait_until(lambda: _status(ad_hoc_key(guarded.id)) == "succeeded", timeout=10), _status(
        ad_hoc_key(guarded.id)
    )
    assert wait_until(lambda: _status("per-task-c") == "succeeded", timeout=10), _status("per-task-c")
    assert submitted.idempotency_key == "per-task-c"
    assert _status(ad_hoc_key(unguarded.id)) is None
    assert not Execution.objects.filter(task="tests.guard.plain").exists()


def test_process_wide_guard__a_task_opts_out(
    worker_of: Callable[[str], CeleryProcess], bodies: Callable[[], list[str]]
) -> None:
    # Given: a worker of the demo project, whose every task is guarded (task_cls)
    worker = worker_of("project")

    # When: the app's plain task and the opted-out one are sent the plain way
    recorded = guard_tasks.plain.delay("d")
    opted_out = guard_tasks.opted_out.delay("e")

    # Then: both run; the app's task is recorded, the opted-out one is not
    assert wait_until(lambda: len(bodies()) == 2, timeout=30), (bodies(), worker.log()[-2000:])
    assert bodies() == ["opted_out:e", "plain:d"]
    assert wait_until(lambda: _status(ad_hoc_key(recorded.id)) == "succeeded", timeout=10)
    assert _status(ad_hoc_key(opted_out.id)) is None
    assert not Execution.objects.filter(task="tests.guard.opted_out").exists()

    # When: a message sent for an execution reaches the opted-out task (a schedule made before it opted out)
    execution = Execution.objects.create(
        idempotency_key="before-opt-out",
        task="tests.guard.opted_out",
        kwargs={"label": "f"},
        scheduled_for=dbclock.now(),
        celery_task_id=str(uuid.uuid4()),
    )
    outbox.publish(celery_app(), [executions.message_row(execution)], now=dbclock.now())

    # Then: the body does not run, and the execution fails naming why (it is never re-sent to run unrecorded)
    assert wait_until(lambda: _status("before-opt-out") == "failed", timeout=30), (
        _status("before-opt-out"),
        worker.log()[-2000:],
    )
    assert "not guarded" in Execution.objects.get(pk=execution.pk).error
    assert bodies() == ["opted_out:e", "plain:d"]

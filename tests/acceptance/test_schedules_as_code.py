"""Real beats and workers: an entry removed from ``beat_schedule`` turns its schedule off; ``expires`` holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from project.celery import app
from scheduler.models import Execution, Schedule
from scheduler.ops import audit, operations
from scheduler.ops.settings_schedules import RETIRED_REASON
from scheduler.tenancy import EVERY_TENANT
from scheduler.worker.receivers import EXPIRED_REASON
from tests.support import tasks as test_tasks
from tests.support.factories import make_schedule
from tests.support.processes import ROOT, CeleryProcess, beat_argv, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _beat_with(entries: dict[str, int], *, name: str, env: dict[str, str], tmp_path: Path) -> CeleryProcess:
    """Start a real beat whose settings' ``CELERY_BEAT_SCHEDULE`` is ``{name: every N seconds}``."""
    module = f"beat_settings_{name}"
    schedule = {entry: {"task": "scheduler.echo", "schedule": seconds} for entry, seconds in entries.items()}
    (tmp_path / f"{module}.py").write_text(
        f"from project.settings import *  # noqa\nCELERY_BEAT_SCHEDULE = {schedule!r}\n"
    )
    env = {**env, "DJANGO_SETTINGS_MODULE": module, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    return CeleryProcess(name, beat_argv(), env, tmp_path / f"{name}.log").start()


def test_an_entry_removed_from_beat_schedule_turns_its_schedule_off_at_the_next_beat_start(
    process_env: dict[str, str], tmp_path: Path
) -> None:
    # Given a beat whose setting has two every-second entries, which both fire
    first = _beat_with({"stays": 1, "goes": 1}, name="beat1", env=process_env, tmp_path=tmp_path)
    try:
        assert wait_until(
            lambda: all(
                Execution.objects.filter(schedule__name=n, enqueued_at__isnull=False).exists()
                for n in ("stays", "goes")
            ),
            timeout=30,
        ), first.log()[-3000:]
    finally:
        first.stop()
    assert set(Schedule.objects.values_list("origin", flat=True)) == {Schedule.Origin.SETTINGS}

    # When a beat starts with one entry removed from its setting
    second = _beat_with({"stays": 1}, name="beat2", env=process_env, tmp_path=tmp_path)
    try:
        # Then the removed entry's schedule is off, with the reason, and keeps its history
        assert wait_until(lambda: not Schedule.objects.get(name="goes").enabled, timeout=30), second.log()[-3000:]
        goes = Schedule.objects.get(name="goes")
        assert goes.disabled_reason == RETIRED_REASON
        assert goes.executions.exists()
        # and the other entry's schedule keeps firing under the new beat
        before = Execution.objects.filter(schedule__name="stays").count()
        assert wait_until(lambda: Execution.objects.filter(schedule__name="stays").count() > before + 1, timeout=30)
    finally:
        second.stop()


def test_a_schedules_expires_cancels_what_a_worker_gets_too_late_without_running_it(
    celery_processes: Callable[..., CeleryProcess], redis_client: redis.Redis
) -> None:
    # Given a run of a schedule whose messages expire 2 s after their slot, sent while no worker runs
    schedule = make_schedule("perishable", task="tests.record", interval=3600, expires=2)
    result = operations.run_now(schedule, app=app, scope=EVERY_TENANT, actor=audit.CLI)
    assert result.broker_error == ""
    time.sleep(3)
    # When a worker starts and gets it
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # Then it is recorded cancelled, with the reason, and its body never ran
    done = wait_until(
        lambda: Execution.objects.filter(pk=result.execution.pk, status__in=Execution.FINAL_STATUSES).first(),
        timeout=30,
    )
    assert done, worker.log()[-3000:]
    assert (done.status, done.error) == (Execution.Status.CANCELLED, EXPIRED_REASON)
    assert test_tasks.events(redis_client) == []
    assert Schedule.objects.get(pk=schedule.pk).total_runs == 0

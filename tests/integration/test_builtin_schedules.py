"""Built-in housekeeping schedules: created once, the operator's edits kept, safe when beats race."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth import get_user_model
from django.test import Client
from django_celery_results.models import TaskResult

from project.celery import app
from scheduler import dbclock, task_policy, tasks
from scheduler.exceptions import PruneRefused
from scheduler.models import Execution, Schedule
from scheduler.ops import builtin_schedules
from scheduler.ops.builtin_schedules import BACKEND_CLEANUP, PRUNE_EXECUTIONS, ensure_builtin_schedules
from scheduler.owners import schedules
from tests.support.factories import make_past_execution, make_schedule
from tests.support.processes import ROOT
from tests.support.replicas import BeatReplica
from tests.support.threads import run_at_once

Status = Execution.Status
BUILTINS = {PRUNE_EXECUTIONS, BACKEND_CLEANUP}


def rows() -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in Schedule.objects.values()}


# --- creating them ------------------------------------------------------------------


@pytest.mark.django_db
def test_ensure__creates_each_builtin_once() -> None:
    # When a beat starts twice
    first = ensure_builtin_schedules(app)
    before = rows()
    second = ensure_builtin_schedules(app)

    # Then both built-ins exist once, daily, overlap=skip, and the second start changed nothing
    assert set(first) == BUILTINS and second == []
    assert rows() == before
    prune, cleanup = Schedule.objects.get(name=PRUNE_EXECUTIONS), Schedule.objects.get(name=BACKEND_CLEANUP)
    assert (prune.task, prune.cron, prune.timezone) == ("scheduler.prune_executions", "17 3 * * *", "UTC")
    assert (cleanup.task, cleanup.cron) == ("celery.backend_cleanup", "0 4 * * *")
    for builtin in (prune, cleanup):
        assert builtin.enabled and builtin.overlap == Schedule.Overlap.SKIP
        assert builtin.next_run_at is not None
        builtin.full_clean()  # as valid as a schedule made in the admin


@pytest.mark.django_db
def test_ensure__keeps_the_operators_edits_and_disabling() -> None:
    # Given built-ins an operator retimed, gave arguments, and disabled
    ensure_builtin_schedules(app)
    prune = Schedule.objects.get(name=PRUNE_EXECUTIONS)
    prune.cron, prune.kwargs, prune.overlap = "0 1 * * 0", {"keep_last": 5}, Schedule.Overlap.ALLOW
    schedules.save(prune)
    cleanup = Schedule.objects.get(name=BACKEND_CLEANUP)
    cleanup.enabled = False
    schedules.save(cleanup)
    before = rows()

    # When a beat restarts
    assert ensure_builtin_schedules(app) == []

    # Then every field is as the operator left it
    assert rows() == before
    assert before[BACKEND_CLEANUP]["enabled"] is False
    assert before[PRUNE_EXECUTIONS]["cron"] == "0 1 * * 0"


@pytest.mark.django_db
def test_ensure__a_deleted_builtin_is_created_again() -> None:
    ensure_builtin_schedules(app)
    Schedule.objects.filter(name=PRUNE_EXECUTIONS).delete()
    assert ensure_builtin_schedules(app) == [PRUNE_EXECUTIONS]
    assert set(rows()) == BUILTINS


@pytest.mark.django_db
def test_ensure__setting_off_creates_none(settings: Any) -> None:
    settings.SCHEDULER_BUILTIN_SCHEDULES = False
    assert ensure_builtin_schedules(app) == []
    assert not Schedule.objects.exists()


@pytest.mark.django_db
def test_ensure__a_schedule_already_running_the_task_replaces_the_builtin() -> None:
    # Given a beat_schedule entry (or a hand-made schedule) for Celery's cleanup
    schedules.create(name="nightly cleanup", task="celery.backend_cleanup", cron="30 2 * * *")
    # When a beat starts, then only the prune is added: the cleanup never runs twice a night
    assert ensure_builtin_schedules(app) == [PRUNE_EXECUTIONS]


@pytest.mark.parametrize(("raw", "expected"), [("0", "False"), ("false", "False"), ("1", "True")])
def test_setting_from_the_environment__zero_or_false_turns_them_off(raw: str, expected: str) -> None:
    # bool("0") would be True: the environment is read like every other switch
    result = subprocess.run(
        [sys.executable, "-c", "import project.settings as s; print(s.SCHEDULER_BUILTIN_SCHEDULES)"],
        env={**os.environ, "DJANGO_DEBUG": "1", "SCHEDULER_BUILTIN_SCHEDULES": raw},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == expected, result.stderr


@pytest.mark.django_db
@pytest.mark.parametrize(
    "config",
    [{"result_backend": "django-db", "result_expires": None}, {"result_backend": "redis://127.0.0.1:1/0"}],
    ids=["results-never-expire", "backend-expires-them-itself"],
)
def test_ensure__no_backend_cleanup_when_celery_would_install_none(config: dict[str, Any]) -> None:
    # Given an app whose results never expire, or whose backend expires them (Redis)
    other = Celery("other", set_as_current=False)
    other.conf.update(config)
    # Then, as Celery's own beat, no cleanup schedule
    assert ensure_builtin_schedules(other) == [PRUNE_EXECUTIONS]


@pytest.mark.django_db(transaction=True)
def test_beat_setup__creates_the_builtins(beat_replica: BeatReplica) -> None:
    # When a beat replica starts
    scheduler = beat_replica()
    scheduler.setup_schedule()
    scheduler.close()
    # Then the built-ins are there, next to nothing else
    assert set(rows()) == BUILTINS


@pytest.mark.django_db(transaction=True)
def test_two_beats_starting_at_once__one_row_each_and_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given two replicas that both find the built-ins missing before either inserts
    both_checked = threading.Barrier(2)
    create = builtin_schedules._create

    def create_after_the_other_checked(name: str, values: dict[str, Any]) -> bool:
        both_checked.wait(timeout=10)
        return create(name, values)

    monkeypatch.setattr(builtin_schedules, "_create", create_after_the_other_checked)
    created: list[str] = []
    errors: list[BaseException] = []

    def start_beat() -> None:
        created.extend(ensure_builtin_schedules(app))

    # When both start on their own connections
    run_at_once([start_beat, start_beat], errors, timeout=60)

    # Then neither failed, and each built-in was created exactly once
    assert not errors, errors
    assert sorted(created) == sorted(BUILTINS)
    assert Schedule.objects.count() == 2


# --- the admin ------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin__edits_a_builtin_like_any_schedule() -> None:
    # Given the built-ins and a logged-in operator
    ensure_builtin_schedules(app)
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    assert b"builtin: prune executions" in client.get("/admin/scheduler/schedule/").content

    for name, task in ((PRUNE_EXECUTIONS, "scheduler.prune_executions"), (BACKEND_CLEANUP, "celery.backend_cleanup")):
        schedule = Schedule.objects.get(name=name)
        # When they change its time and its arguments, and turn it off
        form = {
            "name": name,
            "task": task,
            "args": "[]",
            "kwargs": '{"keep_last": 5}' if task != "celery.backend_cleanup" else "{}",
            "queue": "",
            "description": schedule.description,
            "tenant": "",
            "cron": "45 5 * * *",
            "interval": "",
            "timezone": "UTC",
            "overlap": "skip",
            "catchup_window": "43200",
            "misfire": "run_once",
            "jitter": "0",
            "dst_gap": "shift",
            "dst_fold": "first",
            "max_retries": "0",
            "retry_backoff": "1",
            "paused_reason": "",
        }
        response = client.post(f"/admin/scheduler/schedule/{schedule.pk}/change/", form)
        # Then the admin accepts the task and saves it
        assert response.status_code == 302, response.context["adminform"].form.errors
        schedule.refresh_from_db()
        assert (schedule.cron, schedule.enabled, schedule.next_run_at) == ("45 5 * * *", False, None)

    # ... and a beat restart keeps the edits
    before = rows()
    ensure_builtin_schedules(app)
    assert rows() == before


# --- what they run -------------------------------------------------------------------


@pytest.fixture
def history(db: None) -> Schedule:
    """A schedule with 5 executions 40-44 days old and one a day old; an ad-hoc one 45 days old."""
    schedule = make_schedule("s")
    for n in range(5):
        make_past_execution(f"old-{n}", age_days=40 + n, schedule=schedule)
    make_past_execution("recent", age_days=1, schedule=schedule)
    make_past_execution("adhoc-old", age_days=45)
    return schedule


def keys() -> set[str]:
    return set(Execution.objects.values_list("idempotency_key", flat=True))


def test_prune_task__uses_the_settings(history: Schedule, settings: Any) -> None:
    # Given a 42-day horizon, keeping 4 per schedule
    settings.SCHEDULER_PRUNE_OLDER_THAN_DAYS = 42
    settings.SCHEDULER_PRUNE_KEEP_LAST = 4
    # When the task runs
    result = tasks.prune_executions.run()
    # Then only what is older than 42 days and not among the newest 4 is gone
    assert keys() == {"recent", "old-0", "old-1", "old-2"}
    assert (result["deleted"], result["keep_last"]) == (3, 4)


def test_prune_task__defaults_keep_a_schedules_newest_hundred(history: Schedule) -> None:
    tasks.prune_executions.run()
    assert keys() == {"recent", *(f"old-{n}" for n in range(5))}


def test_prune_task__arguments_win_over_the_settings(history: Schedule) -> None:
    tasks.prune_executions.run(older_than_days=2, keep_last=0)
    assert keys() == {"recent"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"older_than_days": 0}, "older_than_days must be a whole number from 1 to 365000, got 0"),
        ({"older_than_days": "30d"}, "got '30d'"),
        ({"older_than_days": 10**9}, "got 1000000000"),
        ({"keep_last": -1}, "keep_last must be a whole number at least 0, got -1"),
        ({"keep_last": True}, "got True"),
    ],
)
def test_prune_task__bad_arguments_refused_and_nothing_deleted(history: Schedule, kwargs: dict, message: str) -> None:
    with pytest.raises(PruneRefused) as caught:
        tasks.prune_executions.run(**kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert len(keys()) == 7


def test_prune__never_changes_what_a_schedule_counts(history: Schedule) -> None:
    # Given a schedule whose counters say what it has used
    Schedule.objects.filter(pk=history.pk).update(total_runs=6, slots_committed=6, total_missed=3)
    before = Schedule.objects.filter(pk=history.pk).values("total_runs", "slots_committed", "total_missed").get()
    # When its old executions are pruned
    tasks.prune_executions.run(older_than_days=2, keep_last=0)
    # Then the rows are gone but the counts stay
    assert not Execution.objects.filter(idempotency_key__startswith="old-").exists()
    assert (
        Schedule.objects.filter(pk=history.pk).values("total_runs", "slots_committed", "total_missed").get() == before
    )


@pytest.mark.django_db
def test_backend_cleanup__registered_and_deletes_expired_results() -> None:
    # Given results a week old and a minute old (results expire after a day)
    assert task_policy.is_task_registered("celery.backend_cleanup", app=app)
    assert task_policy.is_task_registered("scheduler.prune_executions", app=app)
    for task_id in ("old", "new"):
        TaskResult.objects.create(task_id=task_id, status="SUCCESS")
    TaskResult.objects.filter(task_id="old").update(date_done=dbclock.now() - timedelta(days=7))
    # When Celery's cleanup task runs
    app.tasks["celery.backend_cleanup"].run()
    # Then only the expired one is gone
    assert list(TaskResult.objects.values_list("task_id", flat=True)) == ["new"]

"""Owed slots (pauses, timing edits, pruned history, every schedule audited) and operators' stale saves."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.messages.storage.cookie import CookieStorage
from django.core.management import call_command
from django.db import connection
from django.http import HttpRequest
from django.test import RequestFactory

from project.celery import app
from scheduler import dbclock, timing
from scheduler.beat import LeaderScheduler, dispatch
from scheduler.exceptions import ScheduleWriteRefused
from scheduler.models import Execution, Schedule
from scheduler.ops import operations
from scheduler.ops.reconcile import AUDIT_SCHEDULES, reconcile
from scheduler.owners import executions, leases, schedules
from scheduler.tenancy import EVERY_TENANT
from tests.support.factories import make_schedule
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status
#: Written by the beat, the workers and reconcile: an operator's save must never roll them back.
RUNNING_STATE = (
    "next_run_at",
    "last_run_at",
    "last_status",
    "total_runs",
    "total_missed",
    "slots_committed",
    "consecutive_failures",
    "last_error",
    "enabled",
    "disabled_reason",
    "paused_reason",
)


def command(*argv: str) -> str:
    out = io.StringIO()
    call_command(*argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def repair() -> dict[str, Any]:
    """Run ``manage.py reconcile --repair`` and return its JSON report."""
    return json.loads(command("reconcile", "--repair", "--json"))


# --- item 4: owed slots ---------------------------------------------------------------------


def test_audit__slots_inside_a_pause__not_owed_after_resume(redis_client: redis.Redis) -> None:
    # Given an every-second schedule with a long catch-up window, paused, while slots pass
    target = make_schedule("paused", interval=1, catchup_window=600)
    command("schedules", "pause", "paused", "--reason", "vendor outage")
    paused_at = dbclock.now()
    assert wait_until(lambda: dbclock.now() > paused_at + timedelta(seconds=2.5), timeout=10)

    # When it is resumed and reconcile repairs what it finds missing
    command("schedules", "resume", "paused")
    report = repair()

    # Then nothing of the paused time was owed: no slot recorded, nothing sent
    assert report["counts"].get("slot_recorded", 0) == 0
    assert not Execution.objects.filter(schedule=target).exists()
    assert redis_client.llen("celery") == 0


def test_audit__cron_edited__past_slots_of_the_new_expression_not_owed(redis_client: redis.Redis) -> None:
    # Given a daily schedule created two hours ago with a one-hour catch-up window
    target = make_schedule("edited", cron="0 3 * * *", catchup_window=3600)
    two_hours_ago = dbclock.now() - timedelta(hours=2)
    Schedule.objects.filter(pk=target.pk).update(created_at=two_hours_ago, owed_since=two_hours_ago)

    # When its cron becomes every minute, and reconcile repairs what it finds missing
    command("schedules", "update", "edited", "--cron", "* * * * *")
    report = repair()

    # Then none of the new expression's past minutes was recorded or sent
    assert report["counts"].get("slot_recorded", 0) == 0
    assert not Execution.objects.filter(schedule=target).exists()
    assert redis_client.llen("celery") == 0


def test_audit__catchup_window_longer_than_retention__pruned_slots_not_run_again(redis_client: redis.Redis) -> None:
    # Given a daily schedule 40 days old with a 45-day catch-up window, whose executions
    # older than the retention (30 days by default) were pruned and the newer ones kept
    now = dbclock.now()
    start = (now - timedelta(days=40)).replace(microsecond=0)
    target = make_schedule("daily", interval=86400, start_at=start, catchup_window=45 * 86400)
    Schedule.objects.filter(pk=target.pk).update(created_at=start, owed_since=start)
    kept = timing.slots_between(target.timing, since=now - timedelta(days=30), until=now)
    for slot in kept:
        Execution.objects.create(
            idempotency_key=executions.key(target, slot),
            schedule=target,
            task=target.task,
            scheduled_for=slot,
            status=Status.SUCCEEDED,
            finished_at=slot + timedelta(seconds=1),
        )

    # When reconcile repairs what it finds missing
    report = repair()

    # Then the pruned slots are not recorded or run again
    assert report["counts"].get("slot_recorded", 0) == 0
    assert Execution.objects.filter(schedule=target).count() == len(kept) >= 29
    assert redis_client.llen("celery") == 0


def test_audit__more_schedules_than_one_pass__every_one_audited_over_successive_passes() -> None:
    # Given 2,500 minutely schedules, each with 3 slots in its window that have no execution
    now = dbclock.now()
    last = now.replace(second=0, microsecond=0)
    hour_ago = now - timedelta(hours=1)
    Schedule.objects.bulk_create(
        Schedule(
            name=f"s{index:04}",
            task="scheduler.echo",
            interval=60,
            catchup_window=180,
            next_run_at=last + timedelta(minutes=1),
            owed_since=hour_ago,
        )
        for index in range(2500)
    )
    Schedule.objects.update(created_at=hour_ago)

    # When three passes run, each auditing at most its budget of schedules
    seen: list[set[int]] = []
    for _ in range(3):
        report = reconcile(now=now, app=app)
        seen.append({change.schedule_id for change in report.changes if change.kind == "missing_slot"})

    # Then every schedule was audited by one of them
    assert all(0 < len(ids) <= AUDIT_SCHEDULES for ids in seen)
    assert set().union(*seen) == set(Schedule.objects.values_list("pk", flat=True))


# --- item 5: stale saves ----------------------------------------------------------------------
#
# The schedule fires every 600 s from 1,205 s ago and its next_run_at is its first slot:
# the leader records two slots missed, fires T (5 s ago) and moves next_run_at 10 minutes on.
# With overlap=cancel_previous, a next_run_at written back to the first slot would make the
# next tick plan T again and cancel T's own execution.


def behind(**fields: Any) -> Schedule:
    start = dbclock.now().replace(microsecond=0) - timedelta(seconds=1205)
    target = make_schedule(
        "stale", interval=600, start_at=start, catchup_window=300, overlap="cancel_previous", **fields
    )
    Schedule.objects.filter(pk=target.pk).update(next_run_at=start)
    return target


def slot_t(target: Schedule) -> datetime:
    assert target.start_at is not None
    return target.start_at + timedelta(seconds=1200)


def worker_finishes_a_run(target: Schedule, status: str) -> None:
    """A worker records an earlier execution's outcome on the schedule (its run counters)."""
    earlier = Execution.objects.create(
        idempotency_key=f"earlier-{status}",
        schedule=target,
        task=target.task,
        status=Status.RUNNING,
        scheduled_for=slot_t(target) - timedelta(hours=1),
        started_at=dbclock.now(),
    )
    error = "boom" if status != Status.SUCCEEDED else ""
    assert executions.finish(executions.Claim.of(earlier), status=status, error=error)


def running_state(target: Schedule) -> dict[str, Any]:
    return Schedule.objects.filter(pk=target.pk).values(*RUNNING_STATE).get()


def slot_status(target: Schedule, slot: datetime) -> str:
    return Execution.objects.get(idempotency_key=executions.key(target, slot)).status


def admin_request() -> HttpRequest:
    request = RequestFactory().post("/admin/scheduler/schedule/")
    User = get_user_model()
    user = User.objects.filter(username="root").first()
    request.user = user or User.objects.create_superuser("root", "root@example.invalid", "pw")
    request._messages = CookieStorage(request)  # type: ignore[attr-defined]
    return request


def schedule_admin() -> Any:
    return admin.site._registry[Schedule]


def form_data(form: forms.ModelForm) -> dict[str, Any]:
    """The POST data of a change form as its page shows it (what the operator submits back)."""
    data: dict[str, Any] = {}
    for name, field in form.fields.items():
        value = form[name].value()
        if isinstance(field.widget, forms.MultiWidget):
            parts = enumerate(field.widget.decompress(value))
            data.update({f"{name}_{index}": part for index, part in parts if part is not None})
        elif isinstance(field.widget, forms.CheckboxInput):
            if value:
                data[name] = "on"
        elif value is not None:
            data[name] = value
    return data


#: An operator's action, split where the leader may act: ``load(pk)`` reads what the
#: operator sees (the change page, the selected rows, the command's row) and returns the write.
Load = Callable[[int], Callable[[], None]]


def loaded(pk: int) -> Schedule:
    return Schedule.objects.get(pk=pk)


def command_update(pk: int) -> Callable[[], None]:
    schedule = loaded(pk)

    def write() -> None:
        schedule.description = "edited"
        operations.validate_schedule(schedule, app=app, scope=EVERY_TENANT)
        schedules.save(schedule, now=dbclock.now())

    return write


def command_enable(pk: int) -> Callable[[], None]:
    schedule = loaded(pk)
    return lambda: schedules.set_enabled(schedule, True, now=dbclock.now())


def command_pause(pk: int) -> Callable[[], None]:
    schedule = loaded(pk)
    return lambda: schedules.pause(schedule, "maintenance", now=dbclock.now())


def command_resume(pk: int) -> Callable[[], None]:
    schedule = loaded(pk)
    return lambda: schedules.resume(schedule, now=dbclock.now())


def admin_form(pk: int) -> Callable[[], None]:
    request, model_admin = admin_request(), schedule_admin()
    schedule = loaded(pk)
    form_class = model_admin.get_form(request, schedule, change=True)
    data = form_data(form_class(instance=schedule))

    def write() -> None:
        form = form_class({**data, "description": "edited"}, instance=schedule)
        assert form.is_valid(), form.errors
        edited = model_admin.save_form(request, form, change=True)
        model_admin.save_model(request, edited, form, change=True)

    return write


def admin_action(name: str) -> Load:
    def load(pk: int) -> Callable[[], None]:
        request, model_admin = admin_request(), schedule_admin()
        selected = Schedule.objects.filter(pk=pk)
        list(selected)  # the changelist's rows, read when the operator ticked them
        return lambda: getattr(model_admin, name)(request, selected)

    return load


ACTIVE_PATHS: dict[str, Load] = {
    "schedules update": command_update,
    "schedules enable": command_enable,
    "schedules pause": command_pause,
    "admin form": admin_form,
    "admin enable action": admin_action("enable"),
    "admin pause action": admin_action("pause"),
}
PAUSED_PATHS: dict[str, Load] = {"schedules resume": command_resume, "admin resume action": admin_action("resume")}


@pytest.mark.parametrize("path", ACTIVE_PATHS)
def test_stale_save__leader_fired_after_the_load__nothing_rolled_back(lease: leases.LeaseHandle, path: str) -> None:
    # Given an operator who loaded a schedule, then the leader fired T (missing two slots)
    # and a worker recorded a failed run
    target = behind()
    write = ACTIVE_PATHS[path](target.pk)
    assert dispatch.dispatch_due(lease).fired == [("stale", slot_t(target))]
    worker_finishes_a_run(target, Status.FAILED)
    before = running_state(target)
    assert (before["total_missed"], before["total_runs"], before["consecutive_failures"]) == (2, 1, 1)

    # When the operator's write lands, and the leader ticks again
    write()
    dispatch.dispatch_due(lease)

    # Then the leader's and the worker's state stands (the action's own fields aside),
    # and T's execution was not cancelled by a second plan of T
    after = running_state(target)
    if "pause" in path:
        assert after["paused_reason"] and after["next_run_at"] is None
        after.update(paused_reason="", next_run_at=before["next_run_at"])
    assert after == before
    assert slot_status(target, slot_t(target)) == Status.PENDING
    assert Execution.objects.filter(schedule=target).count() == 4  # 2 missed, T, the worker's


@pytest.mark.parametrize("path", PAUSED_PATHS)
def test_stale_resume__worker_recorded_runs_after_the_load__counts_kept(path: str) -> None:
    # Given an operator who loaded a paused schedule, then a worker recorded a run
    target = behind(paused_reason="maintenance")
    write = PAUSED_PATHS[path](target.pk)
    worker_finishes_a_run(target, Status.SUCCEEDED)
    before = running_state(target)

    # When the operator resumes it
    write()

    # Then it fires from its next slot, with the worker's counts kept
    after = running_state(target)
    assert (after["paused_reason"], after["next_run_at"]) == ("", slot_t(target) + timedelta(seconds=600))
    assert {k: after[k] for k in ("total_runs", "last_status", "last_run_at")} == {
        k: before[k] for k in ("total_runs", "last_status", "last_run_at")
    } and before["total_runs"] == 1


class TickingLeader(threading.Thread):
    """A real LeaderScheduler ticking on its own thread and database connection."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.scheduler = LeaderScheduler(app, lazy=True)
        self.ticks = 0
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self.scheduler.tick()
                self.ticks += 1
                time.sleep(0.02)
        finally:
            self.scheduler.close()
            connection.close()


@pytest.fixture
def ticking_leader(settings: Any, redis_client: redis.Redis) -> Iterator[TickingLeader]:
    settings.SCHEDULER_RECONCILE_INTERVAL_SECONDS = 0
    # A leader that keeps ticking (on PostgreSQL it sleeps inside its tick, up to this long).
    settings.SCHEDULER_MAX_INTERVAL_SECONDS = 0.1
    leader = TickingLeader()
    yield leader
    leader.halt.set()
    leader.join(timeout=30)
    assert not leader.is_alive()


@pytest.mark.parametrize("path", ACTIVE_PATHS)
def test_stale_save__while_a_leader_ticks__its_fire_stands(ticking_leader: TickingLeader, path: str) -> None:
    # Given an operator who loaded a schedule before a ticking leader fired T
    target = behind()
    write = ACTIVE_PATHS[path](target.pk)
    ticking_leader.start()
    assert wait_until(lambda: Execution.objects.filter(schedule=target).count() == 3, timeout=30)
    fired = running_state(target)

    # When the operator's write lands while the leader keeps ticking
    write()
    ticks = ticking_leader.ticks
    assert wait_until(lambda: ticking_leader.ticks >= ticks + 5, timeout=30)

    # Then T still runs, next_run_at did not go back, and the misses were counted once
    after = running_state(target)
    assert slot_status(target, slot_t(target)) in (Status.PENDING, Status.QUEUED)
    assert after["next_run_at"] == (None if "pause" in path else fired["next_run_at"])
    assert after["total_missed"] == 2
    assert Execution.objects.filter(schedule=target).count() == 3


def test_a_schedule_written_around_its_owner_is_refused() -> None:
    # Given a saved schedule
    schedule = make_schedule("owned", interval=60)
    # When code saves, creates or deletes one without scheduler.owners.schedules
    # Then each is refused and the row is left as it was
    schedule.interval = 1
    with pytest.raises(ScheduleWriteRefused):
        schedule.save()
    with pytest.raises(ScheduleWriteRefused):
        Schedule.objects.create(name="around", task="scheduler.echo", interval=60)
    with pytest.raises(ScheduleWriteRefused):
        schedule.delete()
    assert list(Schedule.objects.values_list("name", "interval")) == [("owned", 60)]

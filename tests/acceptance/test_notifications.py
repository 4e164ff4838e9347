"""Real beat and worker: each event reaches a webhook once, signed.

A final failure, after 500s and across a leader killed before delivery; an
overdue schedule and its recovery; a circuit breaker's pause; a leadership
nobody holds, and its return.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.models import Execution, Incident, Notification, NotificationTarget
from scheduler.owners import leases, schedules
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until
from tests.support.webhook_server import webhook_server

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]


def test_a_failure_is_delivered_once_signed_after_two_500s_though_the_leader_died_before_delivering(
    celery_processes: Start,
) -> None:
    with webhook_server(failures=[500, 500]) as (url, received):
        # Given a default webhook target, a worker, and a leader that would deliver only an hour from now
        NotificationTarget.objects.create(name="ops", kind="webhook", address=url, secret="s3cret", is_default=True)
        celery_processes("worker", "w1").wait_for_log(r"ready\.")
        first = celery_processes("beat", "beat1", notify_interval_seconds=3600)
        # When a one-off fails for good
        make_schedule("doomed", task="tests.fail", run_at=dbclock.now() + timedelta(seconds=2))
        assert wait_until(lambda: Notification.objects.exists(), timeout=30), first.log()[-3000:]
        assert Execution.objects.get().status == Execution.Status.FAILED
        # and the leader is killed before it delivered
        assert received.requests == []
        first.send(signal.SIGKILL)
        # Then the next leader delivers it: two 500s, then once
        second = celery_processes("beat", "beat2", notify_interval_seconds=0.2, notify_retry_seconds=0.2)
        assert wait_until(lambda: received.answered_ok(), timeout=60), second.log()[-3000:]
        time.sleep(2)  # and never again
        assert [request["status"] for request in received.requests] == [500, 500, 200]
        assert all(request["signed"] for request in received.requests)
        assert len({request["headers"]["X-Scheduler-Delivery"] for request in received.requests}) == 1
        assert received.requests[-1]["body"]["schedule"] == "doomed"
        note = Notification.objects.get()
        assert note.delivered_at is not None and note.attempts == 3


def _events(received: object, event: str) -> list[dict[str, object]]:
    return [request["body"] for request in received.answered_ok() if request["body"]["event"] == event]  # type: ignore[attr-defined]


def test_an_overdue_schedule_notifies_once_then_its_recovery_once(celery_processes: Start) -> None:
    with webhook_server() as (url, received):
        # Given a schedule that fails every second and is overdue 3 s without a success, notifying a webhook
        hook = NotificationTarget.objects.create(name="ops", kind="webhook", address=url, secret="s3cret")
        schedule = make_schedule("flaky-feed", task="tests.fail", interval=1, alert_after=3)
        schedule.notify.add(hook)
        celery_processes("worker", "w1").wait_for_log(r"ready\.")
        beat = celery_processes("beat", "beat1", notify_interval_seconds=0.2)
        # When it has gone 3 s without a success
        assert wait_until(lambda: _events(received, "schedule_overdue"), timeout=30), beat.log()[-3000:]
        # and it is then fixed: the next run succeeds
        schedule.task = "tests.record"
        schedules.save(schedule)
        assert wait_until(lambda: _events(received, "schedule_recovered"), timeout=30), beat.log()[-3000:]
        time.sleep(2)  # a few more watch passes: nothing announced again
    (overdue,) = _events(received, "schedule_overdue")
    (recovered,) = _events(received, "schedule_recovered")
    assert overdue["schedule"] == recovered["schedule"] == "flaky-feed"
    assert "no longer overdue: it succeeded" in str(recovered["summary"])
    assert not Incident.objects.exists()
    assert all(request["signed"] for request in received.requests)


def test_the_circuit_breaker_pausing_a_schedule_notifies_once(celery_processes: Start) -> None:
    with webhook_server() as (url, received):
        NotificationTarget.objects.create(name="ops", kind="webhook", address=url, secret="s3cret", is_default=True)
        make_schedule("fragile", task="tests.fail", interval=1, pause_after_failures=2)
        celery_processes("worker", "w1").wait_for_log(r"ready\.")
        beat = celery_processes("beat", "beat1", notify_interval_seconds=0.2)
        assert wait_until(lambda: _events(received, "schedule_paused"), timeout=30), beat.log()[-3000:]
        time.sleep(2)
    (paused,) = _events(received, "schedule_paused")
    assert paused["schedule"] == "fragile"
    assert str(paused["reason"]).startswith("Paused after 2 consecutive failures")
    # Each failure was told once: the two that tripped it, and any sent before the pause
    failed = Execution.objects.filter(status=Execution.Status.FAILED).count()
    assert failed >= 2 and len(_events(received, "execution_failed")) == failed


def test_a_leadership_nobody_holds_is_told_by_the_workers_and_its_return_by_the_leader(
    celery_processes: Start,
) -> None:
    with webhook_server() as (url, received):
        # Given the deployer's default webhook, two workers watching, and a leader
        NotificationTarget.objects.create(name="ops", kind="webhook", address=url, secret="s3cret", is_default=True)
        for name in ("w1", "w2"):
            celery_processes("worker", name, notify_leaderless_seconds=2, notify_retry_seconds=0.2).wait_for_log(
                r"ready\."
            )
        first = celery_processes("beat", "beat1", notify_leaderless_seconds=2)
        assert wait_until(lambda: leases.current(settings.LEASE_NAME).is_held, timeout=30), first.log()[-3000:]
        # When the only beat dies and nobody holds the lease for longer than 2 s
        first.send(signal.SIGKILL)
        assert wait_until(lambda: _events(received, "leaderless"), timeout=30)
        assert not _events(received, "leader_back")
        # and a beat starts again
        second = celery_processes("beat", "beat2", notify_leaderless_seconds=2, notify_interval_seconds=0.2)
        assert wait_until(lambda: _events(received, "leader_back"), timeout=30), second.log()[-3000:]
        time.sleep(2)
    # Then each was told once, though two workers watched
    (leaderless,) = _events(received, "leaderless")
    (back,) = _events(received, "leader_back")
    assert leaderless["lease"] == back["lease"] == settings.LEASE_NAME
    assert "the leadership has had no holder" in str(leaderless["summary"])
    assert back["holder"] != leaderless["last_holder"]


def test_a_schedules_check_in_monitor_gets_each_runs_start_and_success(celery_processes: Start) -> None:
    with webhook_server() as (url, received):
        # Given a schedule checking in to a Healthchecks-style monitor, a worker and a leader
        monitor = NotificationTarget.objects.create(name="hc", kind="healthchecks", address=url)
        schedule = make_schedule("nightly", task="tests.record", interval=2)
        schedule.notify.add(monitor)
        celery_processes("worker", "w1").wait_for_log(r"ready\.")
        beat = celery_processes("beat", "beat1", notify_interval_seconds=0.2)
        # When two runs have succeeded and been told
        assert wait_until(lambda: len(received.answered_ok()) >= 4, timeout=30), beat.log()[-3000:]
        beat.stop()
    # Then each run pinged its start and then its success, under its own run id
    by_run: dict[str, list[str]] = {}
    for request in received.requests:
        path, _, run_id = request["path"].partition("?rid=")
        by_run.setdefault(run_id, []).append(path)
    done = [paths for paths in by_run.values() if "/hook" in paths]
    assert len(done) >= 2 and all(paths == ["/hook/start", "/hook"] for paths in done), by_run

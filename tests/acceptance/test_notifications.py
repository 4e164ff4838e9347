"""Real beat and worker: a final failure reaches a webhook once, signed, after 500s, across a leader killed before delivery."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from scheduler import dbclock
from scheduler.models import Execution, Notification, NotificationTarget
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

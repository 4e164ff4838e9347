"""Notifications of final failures: recorded with the failure, delivered once to each target, retried with backoff."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core import mail
from django.test import Client

from scheduler.models import Execution, Notification, NotificationTarget, Schedule
from scheduler.outbox import notifications as delivery
from scheduler.owners import executions
from scheduler.web.permissions import OPERATOR_GROUP
from tests.integration.api_support import TENANT_A, TENANT_B, bind
from tests.support.factories import make_execution, make_schedule
from tests.support.webhook_server import webhook_server

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


@pytest.fixture(autouse=True)
def _retry_at_once(settings: Any) -> None:
    settings.SCHEDULER_NOTIFY_RETRY_SECONDS = 0


def _target(name: str, kind: str = "webhook", *, tenant: str = "", **fields: Any) -> NotificationTarget:
    return NotificationTarget.objects.create(name=name, kind=kind, tenant=tenant, **fields)


def _fail(schedule: Schedule | None, key: str, *, tenant: str = "") -> Execution:
    """An execution that ends failed, through the owner's failure path (not run: a refused message)."""
    execution = make_execution(
        key, schedule=schedule, status=Status.QUEUED, celery_task_id=f"celery-{key}", tenant=tenant, attempt=1
    )
    assert executions.fail_unrun(execution.pk, task=execution.task, celery_task_id=f"celery-{key}", reason="boom")
    return execution


def test_a_final_failure_reaches_the_webhook_once_signed_even_after_two_500s() -> None:
    with webhook_server(failures=[500, 500]) as (url, received):
        # Given a schedule notifying a webhook
        hook = _target("ops", address=url, secret="s3cret")
        schedule = make_schedule("nightly", interval=60)
        schedule.notify.add(hook)
        # When one of its executions fails for good, and the leader delivers three times
        failed = _fail(schedule, "one")
        results = [delivery.deliver_due() for _ in range(4)]
    # Then two attempts failed, the third was delivered, the fourth had nothing left
    assert [(r.delivered, r.failed) for r in results] == [(0, 1), (0, 1), (1, 0), (0, 0)]
    assert [request["status"] for request in received.requests] == [500, 500, 200]
    # Each request was signed, and named the same delivery
    assert all(request["signed"] for request in received.requests)
    assert len({request["headers"]["X-Scheduler-Delivery"] for request in received.requests}) == 1
    body = received.requests[-1]["body"]
    assert (body["event"], body["execution"], body["schedule"], body["status"], body["error"]) == (
        "execution_failed",
        failed.pk,
        "nightly",
        "failed",
        "boom",
    )
    note = Notification.objects.get()
    assert (note.attempts, note.last_error, note.delivered_at is not None) == (3, "", True)


def test_a_tampered_signature_is_what_the_receiver_refuses() -> None:
    with webhook_server(secret="other secret") as (url, received):
        _target("ops", address=url, secret="s3cret", is_default=True)
        _fail(None, "ad-hoc")
        delivery.deliver_due()
    assert [request["signed"] for request in received.requests] == [False]


def test_email_goes_through_djangos_mail_and_slack_gets_text() -> None:
    with webhook_server() as (url, received):
        _target("mail", "email", address="ops@example.invalid", is_default=True)
        _target("chat", "slack", address=url, is_default=True)
        _fail(make_schedule("nightly", interval=60), "one")
        assert delivery.deliver_due().delivered == 2
    (message,) = mail.outbox
    assert message.to == ["ops@example.invalid"]
    assert message.subject.startswith("[scheduler] schedule 'nightly': execution ")
    assert received.requests[0]["body"]["text"] == message.subject


def test_a_schedules_own_targets_then_its_tenants_defaults_then_the_deployers() -> None:
    deployer = _target("deployer", address="http://127.0.0.1:9/", is_default=True)
    tenant_default = _target("a-default", address="http://127.0.0.1:9/", tenant=TENANT_A, is_default=True)
    own = _target("a-own", address="http://127.0.0.1:9/", tenant=TENANT_A)
    other_tenants = _target("b-own", address="http://127.0.0.1:9/", tenant=TENANT_B)
    chooses = make_schedule("chooses", tenant=TENANT_A, interval=60)
    chooses.notify.add(own, other_tenants)  # another tenant's target is never used, even if chosen
    _fail(chooses, "chooses", tenant=TENANT_A)
    _fail(make_schedule("defaults", tenant=TENANT_A, interval=60), "defaults", tenant=TENANT_A)
    _fail(make_schedule("b-defaults", tenant=TENANT_B, interval=60), "b-defaults", tenant=TENANT_B)
    sent = {(n.payload["schedule"], n.target_id) for n in Notification.objects.all()}
    assert sent == {("chooses", own.pk), ("defaults", tenant_default.pk), ("b-defaults", deployer.pk)}


def test_successes_and_retries_notify_nobody_and_a_second_recording_is_a_no_op() -> None:
    _target("ops", address="http://127.0.0.1:9/", is_default=True)
    execution = make_execution("ok", status=Status.SUCCEEDED)
    assert not Notification.objects.exists()
    failed = _fail(None, "failed")
    from scheduler.owners import notifications

    notifications.record_failure(failed.pk)  # again: the event's key makes it a no-op
    assert Notification.objects.count() == 1
    assert execution.status == Status.SUCCEEDED


def test_attempts_run_out_and_the_notification_is_given_up_visibly(settings: Any) -> None:
    settings.SCHEDULER_NOTIFY_MAX_ATTEMPTS = 2
    _target("nobody-listens", address="http://127.0.0.1:9/hook", is_default=True)
    _fail(None, "failed")
    delivery.deliver_due()
    delivery.deliver_due()
    note = Notification.objects.get()
    assert (note.attempts, note.delivered_at, note.gave_up_at is not None) == (2, None, True)
    assert note.last_error
    assert delivery.deliver_due().failed == 0  # given up: not tried again


def test_admin__a_tenants_user_sees_its_targets_and_changes_none() -> None:
    _target("a-hook", address="http://127.0.0.1:9/", tenant=TENANT_A)
    _target("b-hook", address="http://127.0.0.1:9/", tenant=TENANT_B)
    user = bind(get_user_model().objects.create_user("op-a", password="pw", is_staff=True), TENANT_A)
    user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    client = Client()
    client.force_login(user)
    page = client.get("/admin/scheduler/notificationtarget/").content.decode()
    assert "a-hook" in page and "b-hook" not in page
    assert client.get("/admin/scheduler/notificationtarget/add/").status_code == 403
    posted = client.post(
        "/admin/scheduler/notificationtarget/add/",
        {"name": "mine", "tenant": TENANT_A, "kind": "webhook", "address": "http://169.254.169.254/"},
    )
    assert posted.status_code == 403
    assert NotificationTarget.objects.count() == 2

"""Notifications: recorded with their event, delivered once to each target, retried with backoff; targets in the API."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core import mail
from django.core.mail.backends import locmem
from django.db import connection
from django.test import Client

from scheduler import dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import AuditEvent, Execution, Incident, Lease, Notification, NotificationTarget, Schedule
from scheduler.ops import watch
from scheduler.outbox import notifications as delivery
from scheduler.owners import executions, leases, notifications
from scheduler.web.permissions import OPERATOR_GROUP, VIEWER_GROUP
from tests.integration.api_support import TENANT_A, TENANT_B, bind, token_client
from tests.support.admin_forms import page_form
from tests.support.factories import make_execution, make_schedule, succeed
from tests.support.processes import wait_until
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


def test_admin__a_targets_secret_is_on_no_page_and_an_empty_field_keeps_it(staff: Client) -> None:
    # Given a signed webhook of a tenant, and that tenant's operator
    target = _target("a-hook", address="http://127.0.0.1:9/", tenant=TENANT_A, secret="TOP-SECRET")
    user = bind(get_user_model().objects.create_user("op-a", password="pw", is_staff=True), TENANT_A)
    user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    tenant_user = Client()
    tenant_user.force_login(user)
    page = f"/admin/scheduler/notificationtarget/{target.pk}/change/"

    # and a viewer of every tenant
    viewer_user = bind(get_user_model().objects.create_user("viewer", password="pw", is_staff=True))
    viewer_user.groups.add(Group.objects.get(name=VIEWER_GROUP))
    viewer = Client()
    viewer.force_login(viewer_user)

    # When each opens its page
    clients = {"tenant": tenant_user, "viewer": viewer, "deployer": staff}
    seen = {who: client.get(page) for who, client in clients.items()}

    # Then no page holds the secret (as the API shows it to nobody)
    assert {who: answer.status_code for who, answer in seen.items()} == dict.fromkeys(clients, 200)
    assert {who: "TOP-SECRET" in answer.content.decode() for who, answer in seen.items()} == dict.fromkeys(
        clients, False
    )

    # When the deployer saves the page leaving the secret empty, then types a new one
    form = page_form(seen["deployer"].content.decode())
    assert staff.post(page, {**form, "name": "renamed"}).status_code == 302
    target.refresh_from_db()
    assert (target.name, target.secret) == ("renamed", "TOP-SECRET")
    form = page_form(staff.get(page).content.decode())
    assert staff.post(page, {**form, "secret": "NEW-SECRET"}).status_code == 302

    # Then an empty field kept it, and a typed one replaced it
    target.refresh_from_db()
    assert target.secret == "NEW-SECRET"


# --- the events a watch pass and the circuit breaker announce ----------------------------


def test_watch__an_overdue_schedule_opens_one_incident_and_its_success_closes_it() -> None:
    _target("ops", address="http://127.0.0.1:9/", is_default=True)
    # Given a schedule whose window passed without a success
    schedule = make_schedule("feed", interval=60, alert_after=1, now=dbclock.now() - timedelta(minutes=5))
    assert Schedule.objects.overdue(now=dbclock.now()).filter(pk=schedule.pk).exists()
    # When two watch passes run: one incident, one notification
    assert watch.watch(overdue=True).opened == 1
    assert watch.watch(overdue=True).opened == 0
    assert list(Notification.objects.values_list("event", flat=True)) == ["schedule_overdue"]
    # When it succeeds: the next pass closes it, once
    succeed(schedule, "ok")
    assert watch.watch(overdue=True).closed == 1
    assert watch.watch(overdue=True).closed == 0
    assert sorted(Notification.objects.values_list("event", flat=True)) == ["schedule_overdue", "schedule_recovered"]
    assert not Incident.objects.exists()


def test_watch__a_lease_without_holder_past_the_threshold_is_announced_once_and_its_return_too(settings: Any) -> None:
    settings.SCHEDULER_NOTIFY_LEADERLESS_SECONDS = 30
    _target("ops", address="http://127.0.0.1:9/", is_default=True)
    name = scheduler_settings.LEASE_NAME
    # A lease that never had a holder is not watched; one whose holder left 10 s ago is not past the threshold
    assert watch.watch(overdue=False) == watch.WatchReport()
    Lease.objects.create(name=name, holder="gone:1:x", token=3, expires_at=dbclock.now() - timedelta(seconds=10))
    assert watch.watch(overdue=False).opened == 0
    # 40 s ago: announced, once, and the leadership is said to be without a holder
    Lease.objects.filter(name=name).update(expires_at=dbclock.now() - timedelta(seconds=40))
    assert watch.watch(overdue=False) == watch.WatchReport(opened=1, leaderless=True)
    assert watch.watch(overdue=False) == watch.WatchReport(leaderless=True)
    # A holder takes it: its return is announced once
    handle = leases.acquire(name, holder="back:2:y", ttl=30)
    assert handle is not None
    assert watch.watch(overdue=False) == watch.WatchReport(closed=1)
    assert watch.watch(overdue=False) == watch.WatchReport()
    bodies = [n.payload for n in Notification.objects.order_by("pk")]
    assert [(b["event"], b["lease"]) for b in bodies] == [("leaderless", name), ("leader_back", name)]
    assert (bodies[0]["last_holder"], bodies[1]["holder"]) == ("gone:1:x", "back:2:y")


def test_the_circuit_breaker_pausing_a_schedule_notifies_its_targets_with_the_failure() -> None:
    _target("ops", address="http://127.0.0.1:9/", is_default=True)
    schedule = make_schedule("fragile", interval=60, pause_after_failures=2)
    _fail(schedule, "one")
    assert Notification.objects.filter(event="schedule_paused").count() == 0
    last = _fail(schedule, "two")
    (paused,) = Notification.objects.filter(event="schedule_paused")
    assert paused.payload["execution"] == last.pk
    assert paused.payload["reason"].startswith("Paused after 2 consecutive failures")


# --- targets in the API --------------------------------------------------------------------


def _targets(client: Client) -> list[dict[str, Any]]:
    return client.get("/api/v1/notification-targets/").json()


def test_api__a_tenant_reads_its_own_targets_without_secrets_and_changes_none() -> None:
    mine = _target("a-hook", address="http://127.0.0.1:9/", tenant=TENANT_A, secret="a-secret")
    _target("b-hook", address="http://127.0.0.1:9/", tenant=TENANT_B, secret="b-secret")
    _target("deployer", address="http://127.0.0.1:9/", secret="root-secret", is_default=True)
    operator_a = token_client("ops-a", role="operator", tenant=TENANT_A)
    listed = _targets(operator_a)
    assert [t["name"] for t in listed] == ["a-hook"] and "secret" not in listed[0]
    before = list(NotificationTarget.objects.values())
    body = {"name": "ssrf", "kind": "webhook", "address": "http://169.254.169.254/", "secret": "x"}
    assert operator_a.post("/api/v1/notification-targets/", body, content_type="application/json").status_code == 403
    patch = operator_a.patch(
        f"/api/v1/notification-targets/{mine.pk}/", {"address": "http://10.0.0.1/"}, content_type="application/json"
    )
    assert patch.status_code == 403
    assert operator_a.delete(f"/api/v1/notification-targets/{mine.pk}/").status_code == 403
    viewer = token_client("root-viewer", role="viewer")
    assert viewer.post("/api/v1/notification-targets/", body, content_type="application/json").status_code == 403
    assert list(NotificationTarget.objects.values()) == before
    assert not AuditEvent.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "kind": "webhook", "address": "file:///etc/passwd", "secret": "s"}, "address"),
        ({"name": "x", "kind": "webhook", "address": "http://127.0.0.1:9/"}, "secret"),
        ({"name": "x", "kind": "email", "address": "not an address"}, "address"),
        ({"name": "x", "kind": "pager", "address": "http://127.0.0.1:9/"}, "kind"),
        ({"name": "taken", "kind": "slack", "address": "http://127.0.0.1:9/"}, "non_field_errors"),
    ],
)
def test_api__a_bad_target_is_a_400_naming_its_field_and_changes_nothing(body: dict[str, Any], field: str) -> None:
    _target("taken", address="http://127.0.0.1:9/", secret="s")
    deployer = token_client("root", role="operator")
    before = list(NotificationTarget.objects.values())
    answer = deployer.post("/api/v1/notification-targets/", body, content_type="application/json")
    assert answer.status_code == 400 and field in answer.json(), answer.content
    assert list(NotificationTarget.objects.values()) == before


def test_api__the_deployer_creates_changes_and_deletes_a_target_each_audited_with_the_secret_masked() -> None:
    deployer = token_client("root", role="operator")
    body = {"name": "ops", "tenant": TENANT_A, "kind": "webhook", "address": "https://hooks.example/x", "secret": "s1"}
    created = deployer.post("/api/v1/notification-targets/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    pk = created.json()["id"]
    changed = deployer.patch(
        f"/api/v1/notification-targets/{pk}/", {"secret": "s2", "is_default": True}, content_type="application/json"
    )
    assert changed.status_code == 200 and "secret" not in changed.json()
    assert NotificationTarget.objects.get(pk=pk).secret == "s2"
    assert deployer.delete(f"/api/v1/notification-targets/{pk}/").status_code == 204
    events = list(AuditEvent.objects.order_by("pk").values_list("action", "object_type", "changes", "tenant"))
    assert [(action, kind, tenant) for action, kind, _, tenant in events] == [
        ("create", "scheduler.notificationtarget", TENANT_A),
        ("update", "scheduler.notificationtarget", TENANT_A),
        ("delete", "scheduler.notificationtarget", TENANT_A),
    ]
    assert "s1" not in str(events) and "s2" not in str(events)
    assert events[1][2]["secret"] == ["(hidden)", "(changed)"]


# --- check-ins ------------------------------------------------------------------------------


def test_check_ins__each_run_pings_start_then_success_or_failure_with_one_run_id() -> None:
    with webhook_server() as (url, received):
        # Given a schedule checking in to a Healthchecks-style and a Sentry-Crons-style monitor, told nowhere else
        healthchecks = _target("hc", "healthchecks", address=url)
        sentry = _target("sentry", "sentry_crons", address=f"{url}/cron/nightly/key/")
        schedule = make_schedule("nightly", interval=60)
        schedule.notify.add(healthchecks, sentry)
        # When one run succeeds and the next fails for good, and the leader's watch passes twice
        succeed(schedule, "ok")
        failed = _fail(schedule, "boom")
        leader = watch.LeaderWatch()
        leader.run()
        leader.run()  # its window overlaps the last one's: nothing is recorded twice
        assert delivery.deliver_due().delivered == 6
    paths = sorted(request["path"] for request in received.requests)
    ok_id, failed_id = (str(uuid.uuid5(uuid.NAMESPACE_URL, f"execution:{pk}:1")) for pk in (_pk("ok"), failed.pk))
    # Then the monitors got the run's start and end, paired by its id; a run that failed unstarted gets its failure
    assert paths == sorted(
        [
            f"/hook/start?rid={ok_id}",
            f"/hook?rid={ok_id}",
            f"/hook/fail?rid={failed_id}",
            f"/hook/cron/nightly/key/?status=in_progress&check_in_id={ok_id}",
            f"/hook/cron/nightly/key/?status=ok&check_in_id={ok_id}",
            f"/hook/cron/nightly/key/?status=error&check_in_id={failed_id}",
        ]
    )
    assert not any(request["signed"] for request in received.requests)  # plain text, no secret to sign with


def _pk(key: str) -> int:
    return Execution.objects.values_list("pk", flat=True).get(idempotency_key=key)


def test_check_ins__none_for_a_schedule_without_one_and_a_check_in_is_never_a_default() -> None:
    _target("ops", address="http://127.0.0.1:9/", is_default=True)
    succeed(make_schedule("plain", interval=60), "ok")
    watch.LeaderWatch().run()
    assert not Notification.objects.exists()
    deployer = token_client("root", role="operator")
    body = {"name": "hc", "kind": "healthchecks", "address": "https://hc-ping.example/abc", "is_default": True}
    answer = deployer.post("/api/v1/notification-targets/", body, content_type="application/json")
    assert answer.status_code == 400 and "is_default" in answer.json()


def test_a_receiver_slower_than_the_timeout_is_a_failed_attempt_and_the_next_one_delivers(settings: Any) -> None:
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 0.5
    with webhook_server(delays=[2.0]) as (url, received):
        _target("ops", address=url, secret="s3cret", is_default=True)
        _fail(None, "failed")
        first = delivery.deliver_due()
        second = delivery.deliver_due()
        # The slow request is answered too, after the sender gave up: delivery is at least once, by one delivery id
        assert wait_until(lambda: len(received.answered_ok()) == 2, timeout=10)
    assert (first.failed, second.delivered) == (1, 1)
    note = Notification.objects.get()
    assert note.delivered_at is not None and note.attempts == 2
    assert len({request["headers"]["X-Scheduler-Delivery"] for request in received.requests}) == 1


@contextmanager
def garbage_answering_server(answer: bytes, *, every: float = 0.0) -> Iterator[str]:
    """A TCP server that answers every request with ``answer``, not HTTP (one byte per ``every`` s); yield its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                peer, _ = listener.accept()
            except TimeoutError:
                continue
            with peer:
                peer.recv(65536)
                chunks = [answer[i : i + 1] for i in range(len(answer))] if every else [answer]
                for chunk in chunks:
                    if stop.wait(every):
                        return
                    try:
                        peer.sendall(chunk)
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_receiver_answering_a_nul__a_failed_attempt_recorded_and_the_others_delivered() -> None:
    # Given a tenant's target whose receiver answers with a NUL (which PostgreSQL stores in no text), and another's
    with garbage_answering_server(b"\x00bad status\r\n\r\n") as hostile, webhook_server() as (url, received):
        _target("hostile", address=hostile, tenant=TENANT_A, is_default=True)
        _target("fine", address=url, tenant=TENANT_B, is_default=True)
        _fail(make_schedule("a", tenant=TENANT_A, interval=60), "a", tenant=TENANT_A)
        _fail(make_schedule("b", tenant=TENANT_B, interval=60), "b", tenant=TENANT_B)

        # When the leader delivers
        result = delivery.deliver_due()

    # Then the hostile one is a failed attempt, recorded (its NUL replaced), and the other one was delivered
    assert (result.delivered, result.failed) == (1, 1)
    hostile_note = Notification.objects.get(target__name="hostile")
    assert (
        hostile_note.attempts == 1 and "\x00" not in hostile_note.last_error and "bad status" in hostile_note.last_error
    )
    assert len(received.answered_ok()) == 1


def deliver_on_a_thread_of_its_own(*, within: float) -> delivery.Delivered | None:
    """One delivery pass on a thread of its own, as the leader's housekeeping runs it; ``None``: still going after ``within`` s."""
    outcome: list[delivery.Delivered] = []

    def send() -> None:
        try:
            outcome.append(delivery.deliver_due())
        finally:
            connection.close()  # this thread's own

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(within)
    return None if sender.is_alive() else outcome[0]


def test_a_receiver_trickling_its_answer__a_failed_attempt_within_the_timeout(settings: Any) -> None:
    # Given a receiver that sends its answer one byte per 0.2 s, each within the 1 s timeout of a read
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 1.0
    answer = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"." * 200 + b"\r\n\r\n"
    with garbage_answering_server(answer, every=0.2) as trickling:
        _target("trickling", address=trickling, is_default=True)
        _fail(None, "failed")

        # When the leader delivers (the answer would take 44 s)
        outcome = deliver_on_a_thread_of_its_own(within=10)

        # Then the attempt failed when its timeout ran out, not when the receiver stopped
        assert outcome is not None, "the delivery pass waited past its timeout for a trickling receiver"
    assert (outcome.delivered, outcome.failed) == (0, 1)
    assert "timed out" in Notification.objects.get().last_error


def test_a_mail_server_that_never_answers__a_failed_attempt_within_the_timeout(settings: Any) -> None:
    # Given e-mail through an SMTP server that takes the connection and never greets
    settings.SCHEDULER_NOTIFY_TIMEOUT_SECONDS = 1.0
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    with garbage_answering_server(b"") as silent:
        settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", int(silent.rsplit(":", 1)[1].split("/")[0])
        _target("mail", "email", address="ops@example.invalid", is_default=True)
        _fail(None, "failed")

        # When the leader delivers
        outcome = deliver_on_a_thread_of_its_own(within=10)

        # Then the attempt failed when its timeout ran out (Django's SMTP connection has none of its own)
        assert outcome is not None, "the delivery pass waited past its timeout for a silent mail server"
    assert (outcome.delivered, outcome.failed) == (0, 1)


def test_a_receiver_redirecting__a_failed_attempt_naming_the_new_address_and_nothing_sent_there() -> None:
    # Given a webhook whose receiver answers 302 to an address that would answer 200 to anything
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    with garbage_answering_server(ok) as elsewhere:
        moved = f"HTTP/1.1 302 Found\r\nLocation: {elsewhere}\r\nContent-Length: 0\r\n\r\n".encode()
        with garbage_answering_server(moved) as redirecting:
            _target("moved", address=redirecting, is_default=True)
            _fail(None, "failed")

            # When the leader delivers
            result = delivery.deliver_due()

    # Then it is not delivered (a redirect drops the body: the receiver would never get it), and says where to
    assert (result.delivered, result.failed) == (0, 1)
    assert Notification.objects.get().last_error == f"HTTP 302: redirects are not followed; moved to {elsewhere}"


class NoTimeoutBackend(locmem.EmailBackend):
    """A host's mail backend that takes no ``timeout``."""

    def __init__(self, fail_silently: bool = False) -> None:
        super().__init__(fail_silently=fail_silently)


def test_a_mail_backend_without_a_timeout__still_delivers(settings: Any) -> None:
    settings.EMAIL_BACKEND = f"{__name__}.NoTimeoutBackend"
    _target("mail", "email", address="ops@example.invalid", is_default=True)
    _fail(None, "failed")
    assert delivery.deliver_due().delivered == 1
    assert [message.to for message in mail.outbox] == [["ops@example.invalid"]]

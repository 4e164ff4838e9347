"""The scheduler section's overview page: who leads, overdue, failures, oldest queued, paused; within the user's tenant."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution, Notification, NotificationTarget, PauseRule, Schedule
from scheduler.owners import leases
from scheduler.web.permissions import OPERATOR_GROUP
from tests.integration.api_support import TENANT_A, TENANT_B, TENANT_TASK, bind
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db

Status = Execution.Status
PAGE = "/admin/scheduler/"


def _client(*, tenant: str = "", superuser: bool = False) -> Client:
    users = get_user_model().objects
    if superuser:
        user = users.create_superuser("root", "root@example.invalid", "pw")
    else:
        user = bind(users.create_user(f"op-{tenant}", password="pw", is_staff=True), tenant)
        user.groups.add(Group.objects.get(name=OPERATOR_GROUP))
    client = Client()
    client.force_login(user)
    return client


def _row(page: str, row: str) -> str:
    found = re.search(rf'<tr id="overview-{row}">.*?<td>(.*?)</td>', page, re.S)
    assert found, page
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", found.group(1))).strip()


def _seed(tenant: str) -> None:
    """An overdue schedule, a paused one, a failure of the last hour and a queued execution, all of ``tenant``."""
    now = dbclock.now()
    late = make_schedule(f"late-{tenant}", tenant=tenant, task=TENANT_TASK, interval=60)
    Schedule.objects.filter(pk=late.pk).update(overdue_at=now - timedelta(minutes=5))
    make_schedule(f"held-{tenant}", tenant=tenant, task=TENANT_TASK, interval=60, paused_reason="vendor outage")
    make_execution(f"failed-{tenant}", tenant=tenant, task=TENANT_TASK, status=Status.FAILED, finished_at=now)
    make_execution(
        f"waiting-{tenant}",
        tenant=tenant,
        task=TENANT_TASK,
        status=Status.QUEUED,
        queue=f"q-{tenant}",
        scheduled_for=now - timedelta(minutes=10),
    )
    target = NotificationTarget.objects.create(
        name=f"hook-{tenant}", tenant=tenant, kind="webhook", address="http://x/"
    )
    Notification.objects.create(
        key=f"k-{tenant}", target=target, event="execution_failed", tenant=tenant, gave_up_at=now
    )
    PauseRule.objects.create(tenant=tenant, queue=f"q-{tenant}")
    # Old news: a failure two hours ago is not in the last hour
    make_execution(
        f"old-failure-{tenant}",
        tenant=tenant,
        task="old.task",
        status=Status.FAILED,
        finished_at=now - timedelta(hours=2),
    )


def test_overview__answers_each_question_and_links_to_the_list_behind_it() -> None:
    # Given a leader, and one of each problem
    handle = leases.acquire("beat", "host-1:42", ttl=60)
    assert handle is not None
    _seed(TENANT_A)

    # When a superuser opens the scheduler section
    root = _client(superuser=True)
    page = root.get(PAGE).content.decode()

    # Then the overview names each, and links to the filtered lists
    assert _row(page, "leader") == "host-1:42 — cluster page"
    assert _row(page, "overdue") == f"1: late-{TENANT_A}"
    assert _row(page, "failures") == f"{TENANT_TASK}: 1"
    assert re.fullmatch(rf"q-{TENANT_A}: \d+ s", _row(page, "queued")), _row(page, "queued")
    assert _row(page, "paused") == f"1: held-{TENANT_A}"
    assert _row(page, "undelivered") == "1"
    assert _row(page, "pauses") == f"hold queue q-{TENANT_A} of tenant {TENANT_A}"
    assert 'href="/admin/scheduler/schedule/?overdue=yes"' in page
    assert 'href="/admin/scheduler/schedule/?state=paused"' in page
    assert f'href="/admin/scheduler/execution/?status__exact=failed&amp;task={TENANT_TASK}"' in page
    # and each link opens a list that shows it
    assert f"late-{TENANT_A}" in root.get("/admin/scheduler/schedule/?overdue=yes").content.decode()
    listed = root.get(f"/admin/scheduler/execution/?status__exact=failed&task={TENANT_TASK}").content.decode()
    shown = {int(pk) for pk in re.findall(r"/admin/scheduler/execution/(\d+)/change/", listed)}
    assert shown == {Execution.objects.get(idempotency_key=f"failed-{TENANT_A}").pk}


def test_overview__no_leader_is_said_plainly() -> None:
    page = _client(superuser=True).get(PAGE).content.decode()
    assert _row(page, "leader").startswith("no beat leads: nothing is dispatched")


def test_overview__a_tenants_operator_sees_only_that_tenant_and_not_the_beats_hosts() -> None:
    leases.acquire("beat", "host-1:42", ttl=60)
    _seed(TENANT_A)
    _seed(TENANT_B)
    page = _client(tenant=TENANT_B).get(PAGE).content.decode()
    assert _row(page, "leader") == "a beat leads"
    assert _row(page, "overdue") == f"1: late-{TENANT_B}"
    assert _row(page, "paused") == f"1: held-{TENANT_B}"
    assert re.fullmatch(rf"q-{TENANT_B}: \d+ s", _row(page, "queued"))
    assert _row(page, "undelivered") == "1"
    assert _row(page, "pauses") == f"hold queue q-{TENANT_B} of tenant {TENANT_B}"
    assert TENANT_A not in page and "host-1" not in page


def test_overview__is_all_right_when_nothing_is_wrong() -> None:
    leases.acquire("beat", "host-1:42", ttl=60)
    make_schedule("fine", interval=60)
    page = _client(superuser=True).get(PAGE).content.decode()
    assert "— all right" in page
    rows = ("overdue", "failures", "queued", "pauses", "paused", "undelivered")
    assert [_row(page, row) for row in rows] == ["none", "none", "nothing waits", "none", "none", "none"]

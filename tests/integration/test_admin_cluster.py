"""The cluster as the admin shows it after crashes: leader from the lease, stale instances, the no-leader banner."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.template import Context, Template
from django.test import Client, RequestFactory

from scheduler import dbclock
from scheduler.models import Instance, Lease
from scheduler.owners import leases

pytestmark = pytest.mark.django_db


def instance(instance_id: str, *, role: str = "beat", age: float, is_leader: bool = False) -> Instance:
    """An instance whose last heartbeat was ``age`` seconds ago on the database clock."""
    seen = dbclock.now() - timedelta(seconds=age)
    return Instance.objects.create(
        instance_id=instance_id, role=role, hostname="h", pid=1, started_at=seen, last_seen=seen, is_leader=is_leader
    )


def after_two_kills() -> leases.LeaseHandle:
    """Three beats that each wrote is_leader=True; two were killed with SIGKILL, the third holds the lease."""
    instance("host-1-dead", age=416, is_leader=True)
    instance("host-2-dead", age=325, is_leader=True)
    instance("host-3-live", age=1.7, is_leader=True)
    handle = leases.acquire("beat", "host-3-live", ttl=10)
    assert handle is not None
    return handle


def rows(page: str) -> dict[str, str]:
    """Return {instance id: its <tr> opening tag and cells} from the cluster page's instance table."""
    return {m[2]: m[0] for m in re.finditer(r'<tr( class="stale")? data-instance="([^"]+)">.*?</tr>', page, re.DOTALL)}


def test_cluster_page__after_crashes_only_the_lease_holder_leads_and_silent_beats_are_stale(staff: Client) -> None:
    # Given two beats killed long ago and a live one holding the lease, all three flagged is_leader
    after_two_kills()
    # When the cluster page is shown
    page = staff.get("/admin/scheduler/lease/").content.decode()
    # Then only the holder reads leader, and the silent ones are greyed with their age
    shown = rows(page)
    assert set(shown) == {"host-1-dead", "host-2-dead", "host-3-live"}
    assert [iid for iid, row in shown.items() if "<td>yes</td>" in row] == ["host-3-live"]
    # (the ages grow while the page is made: the first request of a process loads the URLconf)
    assert 'class="stale"' in shown["host-1-dead"] and re.search(r"<td>416\.\ds ", shown["host-1-dead"])
    assert 'class="stale"' in shown["host-2-dead"] and re.search(r"<td>325\.\ds ", shown["host-2-dead"])
    assert "stale: no heartbeat for over 10s" in shown["host-1-dead"]
    assert 'class="stale"' not in shown["host-3-live"]
    assert 'id="leader-warning"' not in page


def test_cluster_page__no_lease_holder__no_row_leads_and_the_banner_shows(staff: Client) -> None:
    # Given beats that wrote is_leader=True, and a lease that expired (every beat is dead)
    after_two_kills()
    Lease.objects.filter(name="beat").update(expires_at=dbclock.now() - timedelta(seconds=1))
    # When the cluster page is shown
    page = staff.get("/admin/scheduler/lease/").content.decode()
    # Then nobody leads, and the warning says so
    assert not [iid for iid, row in rows(page).items() if "<td>yes</td>" in row]
    assert 'id="cluster-leader">nobody<' in page
    assert 'id="leader-warning"' in page and "No beat replica holds the lease" in page


def test_cluster_page__worker_is_stale_only_past_the_claim_duration(staff: Client) -> None:
    # Given a worker that wrote its heartbeat 20 s ago (it writes one every 10 s) and one silent for 40 s
    instance("w@h-1", role="worker", age=20)
    instance("w@h-2", role="worker", age=40)
    shown = rows(staff.get("/admin/scheduler/lease/").content.decode())
    # Then only the one silent past the claim duration (30 s) is stale
    assert 'class="stale"' not in shown["w@h-1"]
    assert 'class="stale"' in shown["w@h-2"] and "over 30s" in shown["w@h-2"]


@pytest.mark.parametrize(
    "path",
    [
        "/admin/",
        "/admin/scheduler/schedule/",
        "/admin/scheduler/execution/",
        "/admin/scheduler/instance/",
        "/admin/auth/user/",
    ],
)
def test_admin_pages__warn_while_no_beat_leads(staff: Client, path: str) -> None:
    # Given no beat holds the lease
    # When any admin page is shown, Then it carries the warning
    page = staff.get(path).content.decode()
    assert 'id="leader-warning"' in page and "No beat replica holds the lease" in page

    # Given a leader renewing the lease, Then the warning is gone
    assert leases.acquire("beat", "host-1-abc", ttl=10) is not None
    assert 'id="leader-warning"' not in staff.get(path).content.decode()


def test_admin_login_page__no_warning_for_anonymous_visitors(client: Client) -> None:
    page = client.get("/admin/login/").content.decode()
    assert "leader-warning" not in page and "lease" not in page


def test_leader_warning__one_query(django_assert_num_queries: object) -> None:
    # Given a lease row (expired) and a staff request
    assert leases.acquire("beat", "host-1-abc", ttl=10) is not None
    Lease.objects.filter(name="beat").update(expires_at=dbclock.now() - timedelta(seconds=1))
    request = RequestFactory().get("/admin/")
    request.user = get_user_model().objects.create_superuser("root", "root@example.invalid", "pw")
    template = Template("{% load scheduler_admin %}{% leader_problem as problem %}{{ problem }}")
    # When the tag runs, Then it reads the lease once
    with django_assert_num_queries(1):  # type: ignore[operator]
        text = template.render(Context({"request": request}))
    assert "no beat replica holds the lease" in text


def test_instance_list__leader_column_from_the_lease_not_the_stored_flag(staff: Client) -> None:
    # Given three beats flagged is_leader, one holding the lease
    after_two_kills()
    # When the instance list is shown
    page = staff.get("/admin/scheduler/instance/").content.decode()
    # Then one row shows the leader icon
    assert page.count('alt="True"') == 1
    assert re.search(r'host-3-live.*?alt="True"', page, re.DOTALL)
    detail = staff.get("/admin/scheduler/instance/host-1-dead/change/").content.decode()
    assert 'alt="False"' in detail and "Is leader" not in detail

"""The no-leader banner comes with the app's own admin pages; the site's base template stays the host's.

The demo project opts in to the banner on every admin page (its own
``admin/base_site.html`` uses ``{% leader_warning %}``); a host that does not
gets it on the scheduler's pages only, and keeps Django's (or its own)
``admin/base_site.html``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import django.contrib.admin
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.template.loader import get_template
from django.test import Client, override_settings
from django_celery_results.models import TaskResult

from scheduler import dbclock
from scheduler.owners import leases
from tests.support.factories import make_execution, make_schedule

pytestmark = pytest.mark.django_db

#: The project's TEMPLATES without its own template directory: a host that did not opt in.
PLAIN_HOST = [{**settings.TEMPLATES[0], "DIRS": []}]
BANNER = 'id="leader-warning"'


@pytest.fixture
def staff() -> Iterator[Client]:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    with override_settings(TEMPLATES=PLAIN_HOST):
        yield client


def _app_pages() -> list[str]:
    schedule = make_schedule("nightly")
    execution = make_execution(
        "k1",
        schedule=schedule,
        task=schedule.task,
        scheduled_for=dbclock.now(),
        celery_task_id="c1",
    )
    result = TaskResult.objects.create(task_id="c1", status="SUCCESS")
    return [
        "/admin/scheduler/",
        "/admin/scheduler/schedule/",
        "/admin/scheduler/schedule/add/",
        f"/admin/scheduler/schedule/{schedule.pk}/change/",
        f"/admin/scheduler/schedule/{schedule.pk}/history/",
        f"/admin/scheduler/schedule/{schedule.pk}/delete/",
        f"/admin/scheduler/schedule/{schedule.pk}/backfill/",
        "/admin/scheduler/execution/",
        f"/admin/scheduler/execution/{execution.pk}/change/",
        "/admin/scheduler/lease/",
        "/admin/scheduler/instance/",
        "/admin/scheduler/auditevent/",
        "/admin/django_celery_results/taskresult/",
        f"/admin/django_celery_results/taskresult/{result.pk}/change/",
    ]


def test_the_app_does_not_replace_the_sites_admin_base_template() -> None:
    with override_settings(TEMPLATES=PLAIN_HOST):
        origin = Path(get_template("admin/base_site.html").origin.name)
    assert origin.is_relative_to(Path(django.contrib.admin.__file__).parent), origin


def test_app_pages__warn_once_while_no_beat_leads__host_pages_untouched(staff: Client) -> None:
    # Given no beat holds the lease
    pages = _app_pages()
    # Then every page of the scheduler warns, once, with its stylesheet
    for path in pages:
        response = staff.get(path)
        page = response.content.decode()
        assert response.status_code == 200, path
        assert page.count(BANNER) == 1 and "No beat replica holds the lease" in page, path
    assert "scheduler/admin.css" in staff.get("/admin/scheduler/schedule/").content.decode()
    # And the host's pages are Django's, with no banner
    for path in ("/admin/", "/admin/auth/user/"):
        page = staff.get(path).content.decode()
        assert BANNER not in page and "scheduler/admin.css" not in page, path

    # Given a leader renewing the lease, Then no page warns
    for path in pages:
        assert leases.acquire("beat", "host-1-abc", ttl=10) is not None  # renewed: within 2x the renew interval
        assert BANNER not in staff.get(path).content.decode(), path


def test_demo_project__opted_in__every_admin_page_warns_once() -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    for path in ("/admin/", "/admin/auth/user/", "/admin/scheduler/schedule/", "/admin/scheduler/lease/"):
        assert client.get(path).content.decode().count(BANNER) == 1, path

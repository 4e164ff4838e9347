"""Executions nobody claims show: the oldest queued age by queue on /metrics and on the cluster page."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution
from tests.support.factories import make_execution

pytestmark = pytest.mark.django_db


def _execution(
    key: str, *, queue: str, waited: float, status: str = Execution.Status.QUEUED, **fields: Any
) -> Execution:
    """Record an execution created and due ``waited`` seconds ago (database clock)."""
    then = dbclock.now() - timedelta(seconds=waited)
    execution = make_execution(key, task="tests.record", queue=queue, status=status, scheduled_for=then, **fields)
    Execution.objects.filter(pk=execution.pk).update(created_at=then)  # auto_now_add ignores a given value
    return execution


@pytest.fixture
def backlog() -> None:
    # An orphan queue with a 40-minute-old execution (just re-sent by reconcile, so enqueued_at is fresh)
    now = dbclock.now()
    _execution("orphan-old", queue="orphan", waited=2400, enqueued_at=now)
    _execution("orphan-new", queue="orphan", waited=30, enqueued_at=now)
    # The default queue, 10 seconds behind; a 2-hour countdown not due yet; and a finished old one
    _execution("default", queue="", waited=10, enqueued_at=now)
    _execution("countdown", queue="later", waited=-7200, enqueued_at=now)
    _execution("done", queue="done", waited=9999, status=Execution.Status.SUCCEEDED)


def _sample(text: str, queue: str) -> float | None:
    match = re.search(rf'^scheduler_oldest_queued_seconds\{{queue="{re.escape(queue)}"\}} (\S+)$', text, re.MULTILINE)
    return float(match[1]) if match else None


def test_metrics__oldest_queued_age_by_queue(client: Client, backlog: None) -> None:
    # When Prometheus scrapes
    text = client.get("/metrics").content.decode()
    # Then each queue with queued executions reports its oldest one's wait since it was due
    assert "# TYPE scheduler_oldest_queued_seconds gauge" in text
    assert 2400 <= _sample(text, "orphan") < 2400 + 60
    assert 10 <= _sample(text, "") < 10 + 60
    assert _sample(text, "later") == 0  # not due yet: no wait
    assert _sample(text, "done") is None  # nothing queued there


def test_metrics__no_queued_executions_no_samples(client: Client) -> None:
    text = client.get("/metrics").content.decode()
    assert "# TYPE scheduler_oldest_queued_seconds gauge" in text
    assert "scheduler_oldest_queued_seconds{" not in text


@pytest.fixture
def admin_client_logged_in() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    return client


def test_cluster_page__warns_about_queues_waiting_past_the_threshold(
    admin_client_logged_in: Client, backlog: None, settings: Any
) -> None:
    # Given a warning threshold of 5 minutes
    settings.SCHEDULER_QUEUED_WARNING_SECONDS = 300
    # When an admin opens the cluster page
    response = admin_client_logged_in.get("/admin/scheduler/lease/")
    # Then only the orphan queue is named, with its age
    assert response.status_code == 200
    page = response.content.decode()
    warnings = re.search(r'<ul class="messagelist" id="queue-warnings">(.*?)</ul>', page, re.DOTALL)
    assert warnings, page
    items = re.findall(r"<li[^>]*>(.*?)</li>", warnings[1], re.DOTALL)
    assert len(items) == 1 and items[0].startswith("Queue orphan: its oldest queued execution has waited 24")
    assert "(warning after 300s)" in items[0]

    # And with a threshold above every wait, the page has no queue warning
    settings.SCHEDULER_QUEUED_WARNING_SECONDS = 3600
    assert 'id="queue-warnings"' not in admin_client_logged_in.get("/admin/scheduler/lease/").content.decode()


def test_cluster_page__default_queue_named_as_routed(admin_client_logged_in: Client, settings: Any) -> None:
    # Given an execution without a queue, waiting longer than the threshold
    settings.SCHEDULER_QUEUED_WARNING_SECONDS = 60
    _execution("stuck-default", queue="", waited=600)
    # Then the warning names the default routing
    page = admin_client_logged_in.get("/admin/scheduler/lease/").content.decode()
    assert "Queue (default routing): its oldest queued execution has waited 60" in page

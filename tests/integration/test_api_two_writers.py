"""Two API callers changing different fields of one calendar or notification target at once: both changes are kept.

A ``PATCH`` writes the fields it was given onto the row as stored, read
under the row's lock, so a change made meanwhile by the other caller is
never written back over.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.db.models import Model

from scheduler.models import Calendar, NotificationTarget
from scheduler.ops import operations
from scheduler.web.api import views
from tests.integration.api_support import token_client

pytestmark = pytest.mark.django_db(transaction=True)

#: How long a write waits, once it read the row, for the other to read it too (see the test).
MEET_TIMEOUT = 2.0

ROWS: dict[str, tuple[Callable[[], Model], str, tuple[dict[str, Any], dict[str, Any]]]] = {
    "calendars": (
        lambda: Calendar.objects.create(name="closed", every_tenant=True, rules=[{"weekdays": ["sun"]}]),
        "save_calendar",
        ({"name": "weekends"}, {"rules": [{"weekdays": ["sat"]}]}),
    ),
    "notification-targets": (
        lambda: NotificationTarget.objects.create(name="ops", kind="slack", address="http://127.0.0.1:9/"),
        "save_target",
        ({"name": "on-call"}, {"address": "http://127.0.0.1:8/"}),
    ),
}


@pytest.mark.parametrize("resource", ROWS)
def test_two_patches_of_different_fields_at_once__both_are_kept(monkeypatch: pytest.MonkeyPatch, resource: str) -> None:
    # Given a row and two operators, each changing another field of it
    make, save_action, changes = ROWS[resource]
    row = make()
    url = f"/api/v1/{resource}/{row.pk}/"
    clients = [token_client(f"ops{n}", role="operator") for n in range(2)]
    # The worst interleaving: each write, once it read the row, waits for the other to have read it too. Read
    # under the row's lock, the other never gets there (it waits for the lock) and the first goes on after
    # MEET_TIMEOUT; read unlocked, both would write back what they read, and the second undoes the first.
    meet = threading.Barrier(2)
    save = getattr(operations, save_action)

    def meet_then_save(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=MEET_TIMEOUT)
        return save(*args, **kwargs)

    monkeypatch.setattr(views.operations, save_action, meet_then_save)
    statuses: list[int] = []

    def patch(n: int) -> None:
        try:
            statuses.append(clients[n].patch(url, changes[n], content_type="application/json").status_code)
        finally:
            connection.close()

    # When both send their PATCH at once
    threads = [threading.Thread(target=patch, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Then both succeeded, and the row has both changes
    assert statuses == [200, 200]
    row.refresh_from_db()
    assert {field: getattr(row, field) for change in changes for field in change} == {**changes[0], **changes[1]}

"""Two people with one row's admin page open: each page writes what its operator changed, and never undoes the other's.

Every page that changes a row (a schedule, a rate or concurrency limit, a
calendar, a notification target) is opened twice, as two operators would,
and saved from both: one after the other, and both at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Model
from django.test import Client

from scheduler.models import Calendar, ConcurrencyLimit, NotificationTarget, RateLimit
from scheduler.owners import work_rules
from scheduler.web.two_editors import KeepsOthersChanges
from tests.support.admin_forms import page_form
from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db

#: How long a save waits, past its check, for the other save to get past it too (see the test at once).
MEET_TIMEOUT = 2.0


def _rate_limit() -> Model:
    row = RateLimit(name="api", every_tenant=True, starts=10, per_seconds=1)
    work_rules.save_limit(row)
    return row


def _concurrency_limit() -> Model:
    row = ConcurrencyLimit(name="reports", every_tenant=True, limit=2)
    work_rules.save_limit(row)
    return row


@dataclass(frozen=True)
class Edit:
    field: str
    posted: str
    stored: Any


@dataclass(frozen=True)
class Page:
    """A model's change page, a row to open on it, and two edits of different fields."""

    model: str
    make: Callable[[], Model]
    first: Edit
    second: Edit
    #: Another value of the first edit's field
    rival: Edit

    def of(self, row: Model) -> str:
        return f"/admin/scheduler/{self.model}/{row.pk}/change/"


PAGES = [
    Page(
        "schedule",
        lambda: make_schedule("shared", interval=60),
        Edit("interval", "120", 120),
        Edit("queue", "slow", "slow"),
        Edit("interval", "300", 300),
    ),
    Page(
        "ratelimit",
        _rate_limit,
        Edit("starts", "20", 20),
        Edit("task", "api.*", "api.*"),
        Edit("starts", "30", 30),
    ),
    Page(
        "concurrencylimit",
        _concurrency_limit,
        Edit("limit", "3", 3),
        Edit("queue", "slow", "slow"),
        Edit("limit", "4", 4),
    ),
    Page(
        "calendar",
        lambda: Calendar.objects.create(name="closed", every_tenant=True, rules=[{"weekdays": ["sun"]}]),
        Edit("rules", '[{"weekdays": ["sat"]}]', [{"weekdays": ["sat"]}]),
        Edit("name", "weekends", "weekends"),
        Edit("rules", '[{"weekdays": ["mon"]}]', [{"weekdays": ["mon"]}]),
    ),
    Page(
        "notificationtarget",
        lambda: NotificationTarget.objects.create(name="ops", kind="slack", address="http://127.0.0.1:9/"),
        Edit("address", "http://127.0.0.1:8/", "http://127.0.0.1:8/"),
        Edit("name", "on-call", "on-call"),
        Edit("address", "http://127.0.0.1:7/", "http://127.0.0.1:7/"),
    ),
]
IDS = [page.model for page in PAGES]


def _stored(row: Model, *fields: str) -> tuple[Any, ...]:
    row.refresh_from_db()
    return tuple(getattr(row, field) for field in fields)


@pytest.fixture(autouse=True)
def _fresh_rules() -> None:
    work_rules.forget()


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_two_people_change_different_fields__each_keeps_the_change_they_made(staff: Client, page: Page) -> None:
    # Given two operators with the same row's page open
    row = page.make()
    first, second = (page_form(staff.get(page.of(row)).content.decode()) for _ in range(2))

    # When one changes a field, and then the other, from the page opened before, another field
    assert staff.post(page.of(row), {**first, page.first.field: page.first.posted}).status_code == 302
    assert staff.post(page.of(row), {**second, page.second.field: page.second.posted}).status_code == 302

    # Then both changes are kept: the second page wrote only what its operator changed
    assert _stored(row, page.first.field, page.second.field) == (page.first.stored, page.second.stored)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_two_people_change_one_field__the_second_is_told_and_changes_nothing(staff: Client, page: Page) -> None:
    # Given two operators with the same row's page open
    row = page.make()
    first, second = (page_form(staff.get(page.of(row)).content.decode()) for _ in range(2))

    # When both change one field, one after the other, the second also changing another field
    assert staff.post(page.of(row), {**first, page.first.field: page.first.posted}).status_code == 302
    answer = staff.post(
        page.of(row), {**second, page.rival.field: page.rival.posted, page.second.field: page.second.posted}
    )

    # Then the second sees why on the page, and the row is as the first left it
    assert answer.status_code == 200
    assert "changed by someone else" in str(answer.context["adminform"].form.errors[page.first.field])
    first_field, second_field = _stored(row, page.first.field, page.second.field)
    assert first_field == page.first.stored and second_field != page.second.stored


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_two_pages_saved_at_once__one_change_wins_the_other_is_told(
    monkeypatch: pytest.MonkeyPatch, page: Page
) -> None:
    # Given two operators with the same row's page open, both changing one field
    row = page.make()
    operators = []
    for n in range(2):
        client = Client()
        client.force_login(get_user_model().objects.create_superuser(f"op{n}", f"op{n}@example.invalid", "pw"))
        operators.append((client, page_form(client.get(page.of(row)).content.decode())))
    # The worst interleaving: each save, once past the check against what others wrote, waits for the other
    # to get past it too. Checked and written under the row's lock, the other never gets there (it waits for
    # the lock) and the first goes on after MEET_TIMEOUT; checked unlocked, both would pass and both write.
    meet = threading.Barrier(2)
    check = KeepsOthersChanges.keep_what_others_wrote

    def check_then_meet(form: KeepsOthersChanges) -> None:
        check(form)
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=MEET_TIMEOUT)

    monkeypatch.setattr(KeepsOthersChanges, "keep_what_others_wrote", check_then_meet)
    saved: list[Any] = []
    statuses: list[int] = []

    def save(client: Client, form: dict[str, Any], edit: Edit) -> None:
        try:
            status = client.post(page.of(row), {**form, edit.field: edit.posted}).status_code
            statuses.append(status)
            if status == 302:
                saved.append(edit.stored)
        finally:
            connection.close()

    # When both save at once
    edits = (page.first, page.rival)
    threads = [threading.Thread(target=save, args=(*operator, edit)) for operator, edit in zip(operators, edits)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Then one is saved, the other page is shown again with why, and the stored value is the saved one
    assert sorted(statuses) == [200, 302]
    assert list(_stored(row, page.first.field)) == saved

"""The schedule page previews the next fire times, across DST transitions, per policy."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest
import time_machine
from django.test import Client
from django.urls import reverse

from tests.support.factories import make_schedule

pytestmark = pytest.mark.django_db


def preview(client: Client, **fields: str) -> str:
    schedule = make_schedule("nightly", cron="30 2 * * *", timezone="Europe/Berlin", **fields)
    response = client.get(reverse("admin:scheduler_schedule_change", args=[schedule.pk]))
    assert response.status_code == 200
    return re.sub(r"<[^>]+>", "", response.content.decode())  # text only


@pytest.mark.parametrize(
    ("fold", "expected", "absent"),
    [
        ("first", ["Sun 2026-10-25 02:30:00 CEST (2026-10-25 00:30:00 UTC)"], ["02:30:00 CET (2026-10-25"]),
        ("last", ["Sun 2026-10-25 02:30:00 CET (2026-10-25 01:30:00 UTC)"], ["02:30:00 CEST (2026-10-25"]),
        (
            "both",
            [
                "Sun 2026-10-25 02:30:00 CEST (2026-10-25 00:30:00 UTC)",
                "Sun 2026-10-25 02:30:00 CET (2026-10-25 01:30:00 UTC)",
            ],
            [],
        ),
    ],
)
def test_preview__fall_back_day_follows_dst_fold(
    admin_client: Client, fold: str, expected: list[str], absent: list[str]
) -> None:
    with time_machine.travel(datetime(2026, 10, 23, 12, tzinfo=timezone.utc), tick=False):
        page = preview(admin_client, dst_fold=fold)
    for text in expected:
        assert text in page
    for text in absent:
        assert text not in page
    assert "Mon 2026-10-26 02:30:00 CET (2026-10-26 01:30:00 UTC)" in page


@pytest.mark.parametrize(
    ("gap", "spring_day"),
    [("shift", "Sun 2026-03-29 03:00:00 CEST (2026-03-29 01:00:00 UTC)"), ("skip", None)],
)
def test_preview__spring_forward_day_follows_dst_gap(admin_client: Client, gap: str, spring_day: str | None) -> None:
    with time_machine.travel(datetime(2026, 3, 27, 12, tzinfo=timezone.utc), tick=False):
        page = preview(admin_client, dst_gap=gap)
    assert "Sat 2026-03-28 02:30:00 CET (2026-03-28 01:30:00 UTC)" in page
    assert "Mon 2026-03-30 02:30:00 CEST (2026-03-30 00:30:00 UTC)" in page
    if spring_day:
        assert spring_day in page
    else:
        assert "2026-03-29" not in page

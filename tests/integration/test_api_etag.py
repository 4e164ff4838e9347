"""ETag / If-Match on schedule updates: two editors holding the same version cannot both write."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.test import Client

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules
from scheduler.web.api import serializers
from tests.integration.api_support import make_schedule, token_client

#: Longest a writer waits for the other one to reach the write (seconds); only a broken lock lets it arrive.
MEET_TIMEOUT = 2.0


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    cache.clear()


@pytest.mark.django_db
def test_schedule_update__etag_roundtrip_and_stale_etag_is_412() -> None:
    # Given: a schedule read with its ETag
    client = token_client("editor", role="operator")
    schedule = make_schedule("edited")
    read = client.get(f"/api/v1/schedules/{schedule.pk}/")
    tag = read["ETag"]

    # When: it is changed with that ETag; Then: 200 and a new ETag
    first = client.patch(
        f"/api/v1/schedules/{schedule.pk}/", {"queue": "q1"}, content_type="application/json", HTTP_IF_MATCH=tag
    )
    assert first.status_code == 200
    assert first["ETag"] != tag

    # When: it is changed again with the old ETag; Then: 412, nothing written
    stale = client.patch(
        f"/api/v1/schedules/{schedule.pk}/", {"queue": "q2"}, content_type="application/json", HTTP_IF_MATCH=tag
    )
    assert stale.status_code == 412
    assert Schedule.objects.get(pk=schedule.pk).queue == "q1"


@pytest.mark.django_db
def test_schedule_update__runs_counted_since_the_read__not_an_edit_so_200() -> None:
    # Given: a schedule read with its ETag
    client = token_client("editor", role="operator")
    schedule = make_schedule("busy")
    tag = client.get(f"/api/v1/schedules/{schedule.pk}/")["ETag"]

    # When: a worker counts runs of it (an every-second schedule does all the time), then the editor writes
    schedules.count_run(schedule.pk, status=Execution.Status.SUCCEEDED, error="", started_at=dbclock.now())
    answer = client.patch(
        f"/api/v1/schedules/{schedule.pk}/", {"queue": "q1"}, content_type="application/json", HTTP_IF_MATCH=tag
    )

    # Then: the write is no conflict: nobody edited the schedule
    assert answer.status_code == 200


@pytest.mark.django_db
def test_schedule_update__paused_since_the_read__412() -> None:
    # Given: a schedule read with its ETag
    client = token_client("editor", role="operator")
    schedule = make_schedule("paused meanwhile")
    tag = client.get(f"/api/v1/schedules/{schedule.pk}/")["ETag"]

    # When: someone pauses it, then the editor writes with the ETag read before
    assert (
        client.post(f"/api/v1/schedules/{schedule.pk}/pause/", {}, content_type="application/json").status_code == 200
    )
    answer = client.patch(
        f"/api/v1/schedules/{schedule.pk}/", {"queue": "q1"}, content_type="application/json", HTTP_IF_MATCH=tag
    )

    # Then: refused: the schedule changed since it was read
    assert answer.status_code == 412


@pytest.mark.django_db(transaction=True)
def test_schedule_update__two_concurrent_patches_with_one_etag__one_200_one_412(monkeypatch: Any) -> None:
    # Given: a schedule, its ETag, and two editors holding it
    schedule = make_schedule("contended")
    tag = token_client("tag-reader", role="operator").get(f"/api/v1/schedules/{schedule.pk}/")["ETag"]
    clients = [token_client(f"editor-{n}", role="operator") for n in range(2)]
    for client in clients:
        client.get("/api/v1/schedules/")  # marks the token used now: the PATCHes below write nothing else
    # The worst interleaving: each writer, once past the ETag check, waits for the
    # other to get past it too. With the check and the write under one row lock
    # the other never gets there (it waits for the lock), and the first goes on
    # after MEET_TIMEOUT; with an unlocked check both would pass and both write.
    meet = threading.Barrier(2)
    validate = serializers.ScheduleSerializer.validate

    def validate_after_meeting(self: Any, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            meet.wait(timeout=MEET_TIMEOUT)
        except threading.BrokenBarrierError:
            pass
        return validate(self, attrs)

    monkeypatch.setattr(serializers.ScheduleSerializer, "validate", validate_after_meeting)
    statuses: list[int] = []
    queues: list[str] = []

    def edit(client: Client, queue: str) -> None:
        try:
            response = client.patch(
                f"/api/v1/schedules/{schedule.pk}/",
                {"queue": queue},
                content_type="application/json",
                HTTP_IF_MATCH=tag,
            )
            statuses.append(response.status_code)
            if response.status_code == 200:
                queues.append(queue)
        finally:
            connection.close()

    # When: both send their PATCH at once
    threads = [threading.Thread(target=edit, args=(client, f"q{n}")) for n, client in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    # Then: one wins, the other is told the schedule changed, and the winner's value is stored
    assert sorted(statuses) == [200, 412]
    assert Schedule.objects.get(pk=schedule.pk).queue == queues[0]

"""Real beats: a schedule with two crons fires each of their merged slots once, across a restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from scheduler.models import Execution
from scheduler.owners import executions
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_crons_sharing_slots_fire_each_slot_once_and_keep_their_keys_across_a_restart(
    celery_processes: Callable[..., CeleryProcess],
) -> None:
    # Given a schedule every 2 s and every 3 s (6-field crons, seconds first): every 6 s they meet
    schedule = make_schedule("merged", cron="*/2 * * * * *; */3 * * * * *", catchup_window=60)
    # When a beat runs it, stops, and another starts
    first = celery_processes("beat", "beat1")
    assert wait_until(lambda: Execution.objects.filter(schedule=schedule).count() >= 4, timeout=30), first.log()[-3000:]
    first.stop()
    second = celery_processes("beat", "beat2")
    count = Execution.objects.filter(schedule=schedule).count()
    assert wait_until(lambda: Execution.objects.filter(schedule=schedule).count() >= count + 4, timeout=30), (
        second.log()[-3000:]
    )
    second.stop()
    time.sleep(0.5)
    # Then every slot is one of theirs, recorded once under its stable key, and no slot between is missing
    rows = list(Execution.objects.filter(schedule=schedule).order_by("scheduled_for"))
    slots = [row.scheduled_for for row in rows]
    assert len(set(slots)) == len(slots)
    assert all(slot.second % 2 == 0 or slot.second % 3 == 0 for slot in slots)
    assert all(row.idempotency_key == executions.key(schedule, row.scheduled_for) for row in rows)
    expected = [
        slots[0] + timedelta(seconds=k)
        for k in range(int((slots[-1] - slots[0]).total_seconds()) + 1)
        if (slots[0].second + k) % 2 == 0 or (slots[0].second + k) % 3 == 0
    ]
    assert slots == expected
    assert any(slot.second % 6 == 0 for slot in slots)
    assert slots[0] >= schedule.created_at.replace(microsecond=0)  # no slot from before it existed

"""An operator's edits race a real leader that commits slots ahead of their instant: no slot lost, none stale.

A real ``celery beat`` leads every-second schedules with the widest window
(0.5 s: a slot is committed ahead half of the time), while this process
edits their kwargs as the admin does, every 50-200 ms, for 8 s. Each edit
must give back a slot committed ahead of its instant, so the slot is
planned again from the edited row. Afterwards, for every schedule: its
slots are one second apart with none missing, every execution due after an
edit committed carries that edit or a later one, and ``slots_committed``
counts its executions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
EDIT_SECONDS = 8.0


def test_kwargs_edits__racing_the_commit_ahead__lose_no_slot_and_send_no_stale_one(celery_processes: Start) -> None:
    # Given three every-second schedules at version 0, and a leader committing 0.5 s ahead
    made = [make_schedule(f"edited-{index}", interval=1, kwargs={"v": 0}) for index in range(3)]
    beat = celery_processes("beat", "leader", commit_ahead_seconds=0.5)
    assert wait_until(lambda: leases.current("beat").is_held, timeout=30), beat.log()[-3000:]
    assert wait_until(lambda: Execution.objects.count() >= 3, timeout=15), beat.log()[-3000:]

    # When this process edits their kwargs again and again, noting when each edit committed
    committed: dict[int, list[tuple[datetime, int]]] = {schedule.pk: [] for schedule in made}
    rng = random.Random(31)
    version = 0
    deadline = time.monotonic() + EDIT_SECONDS
    while time.monotonic() < deadline:
        version += 1
        schedule = Schedule.objects.get(pk=made[version % len(made)].pk)
        schedule.kwargs = {"v": version}
        schedule.full_clean()
        schedules.save(schedule)
        committed[schedule.pk].append((dbclock.now(), version))  # read after the commit: never too early
        time.sleep(rng.uniform(0.05, 0.2))
    time.sleep(1.5)
    beat.stop()
    assert beat.popen is not None and beat.popen.returncode == 0, beat.log()[-3000:]

    for schedule in made:
        rows = list(
            Execution.objects.filter(schedule=schedule).order_by("scheduled_for").values_list("scheduled_for", "kwargs")
        )
        slots = [slot for slot, _ in rows]
        # Then its slots follow one another a second apart, none lost or doubled
        assert len(slots) >= EDIT_SECONDS, (schedule.name, slots)
        gaps = [(a, b) for a, b in zip(slots, slots[1:]) if b - a != timedelta(seconds=1)]
        assert not gaps, (schedule.name, gaps)
        # ... each carries every edit that committed before its instant
        stale = [
            (slot, kwargs["v"], newest)
            for slot, kwargs in rows
            if kwargs["v"] < (newest := max((v for at, v in committed[schedule.pk] if at < slot), default=0))
        ]
        assert not stale, (schedule.name, stale)
        # ... and its count of committed slots is its count of executions
        schedule.refresh_from_db()
        assert schedule.slots_committed == len(rows), schedule.name


ONE_OFFS = 12


def test_one_off_edits__racing_the_commit_ahead__each_fires_once_and_never_stale(celery_processes: Start) -> None:
    # Given a leader committing 0.5 s ahead, and one-offs due every half second from 3 s on, at version 0
    beat = celery_processes("beat", "leader", commit_ahead_seconds=0.5)
    assert wait_until(lambda: leases.current("beat").is_held, timeout=30), beat.log()[-3000:]
    first = dbclock.now() + timedelta(seconds=3)
    made = [
        make_schedule(f"one-off-{index}", run_at=first + timedelta(seconds=index / 2), kwargs={"v": 0})
        for index in range(ONE_OFFS)
    ]

    # When this process edits the kwargs of those not due yet, as it loads them (shown turned off once committed)
    committed: dict[int, list[tuple[datetime, int]]] = {schedule.pk: [] for schedule in made}
    rng = random.Random(37)
    version = 0
    while coming := [s for s in made if s.run_at > dbclock.now()]:
        version += 1
        schedule = Schedule.objects.get(pk=coming[version % min(len(coming), 2)].pk)  # the next two due
        schedule.kwargs = {"v": version}
        schedules.save(schedule)
        committed[schedule.pk].append((dbclock.now(), version))  # read after the commit: never too early
        time.sleep(rng.uniform(0.02, 0.1))
    assert wait_until(
        lambda: Execution.objects.filter(status=Execution.Status.QUEUED).count() >= ONE_OFFS, timeout=15
    ), beat.log()[-3000:]
    beat.stop()
    assert beat.popen is not None and beat.popen.returncode == 0, beat.log()[-3000:]

    for schedule in made:
        rows = list(Execution.objects.filter(schedule=schedule).values_list("scheduled_for", "kwargs"))
        # Then each fired once, at its instant, carrying every edit that committed before it
        assert [slot for slot, _ in rows] == [schedule.run_at], (schedule.name, rows)
        newest = max((v for at, v in committed[schedule.pk] if at < schedule.run_at), default=0)
        assert rows[0][1]["v"] >= newest, (schedule.name, rows, newest)
        # ... and is off as done, with one slot counted
        schedule.refresh_from_db()
        assert (schedule.enabled, schedule.slots_committed) == (False, 1), schedule.name
        assert schedule.disabled_reason.endswith("has been dispatched"), schedule.disabled_reason

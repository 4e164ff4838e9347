"""The leader commits an interval or one-off schedule's slot ahead of its instant, sends it no sooner, and gives it back on any change.

In process, on the suite's databases and Redis. The window is widened (30 s,
a slot 20 s away) so that no step races the instant on a slow machine;
the tests that need the instant to pass wait 2 s for it, and one of them
races a give-back against it on purpose.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from django.db import connection, transaction

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.beat import LeaderScheduler
from scheduler.models import Execution, Schedule
from scheduler.owners import schedules
from tests.support.factories import make_schedule
from tests.support.processes import wait_until
from tests.support.replicas import TICK_SLEEP, BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)

AHEAD = 30.0
Status = Execution.Status
#: The schedules committed ahead: an interval one moves to its next slot, a one-off turns itself off.
KINDS = ("interval", "one-off")


@pytest.fixture
def beat(settings: Any, beat_replica: BeatReplica) -> LeaderScheduler:
    settings.SCHEDULER_COMMIT_AHEAD_SECONDS = AHEAD
    return beat_replica(max_interval=TICK_SLEEP)


def due_in(schedule: Schedule, seconds: float) -> datetime:
    """Move ``schedule``'s next slot to ``seconds`` from now (the database clock); return the slot."""
    slot = dbclock.now() + timedelta(seconds=seconds)
    Schedule.objects.filter(pk=schedule.pk).update(next_run_at=slot)
    return slot


def make_due_in(kind: str, seconds: float, name: str = "ahead") -> tuple[Schedule, datetime]:
    """A schedule of ``kind`` whose next slot is ``seconds`` from now (the database clock); return it and the slot."""
    if kind == "one-off":
        schedule = make_schedule(name, run_at=dbclock.now() + timedelta(seconds=seconds))
        assert schedule.next_run_at == schedule.run_at
        return schedule, schedule.run_at
    schedule = make_schedule(name, interval=3600)
    return schedule, due_in(schedule, seconds)


def committed_ahead(beat: LeaderScheduler, schedule: Schedule, slot: datetime) -> Execution:
    """Tick ``beat`` and return the ``pending`` row it committed for ``slot`` before the instant."""
    beat.tick()
    assert beat.leadership.held, "the beat did not take the lease"
    row = Execution.objects.get(schedule=schedule, scheduled_for=slot)
    assert row.status == Status.PENDING
    schedule.refresh_from_db()
    if schedule.run_at is None:
        assert (schedule.next_run_at, schedule.enabled) == (slot + timedelta(seconds=schedule.interval or 0), True)
    else:  # its last slot: the one-off turned itself off
        assert (schedule.next_run_at, schedule.enabled) == (None, False)
        assert schedule.disabled_reason.endswith("has been dispatched")
    assert schedule.slots_committed == 1
    return row


@pytest.mark.parametrize("kind", KINDS)
def test_slot__committed_ahead_sent_at_its_instant_once(beat: LeaderScheduler, kind: str) -> None:
    # Given an interval or one-off schedule whose next slot is 2 s away
    schedule, slot = make_due_in(kind, 2)

    # When the leader ticks: the slot is committed now, not sent
    row = committed_ahead(beat, schedule, slot)
    assert outbox.publish_pending(app) == 0, "a publisher sent a slot before its instant"

    # Then once its instant passed, the next tick sends it, once
    while dbclock.now() < slot:
        time.sleep(0.05)
    beat.tick()
    row.refresh_from_db()
    assert row.status == Status.QUEUED
    assert row.enqueued_at is not None and row.enqueued_at >= slot
    assert Execution.objects.filter(schedule=schedule).count() == 1


#: The leader's next look in the test below: far past the test's own time limit.
NEXT_LOOK_SECONDS = 300


# A sleep that ran to the leader's next look instead of the second instant outlasts this limit.
@pytest.mark.timeout(NEXT_LOOK_SECONDS // 5)
def test_slots_at_two_instants__each_sent_at_its_own(settings: Any, beat: LeaderScheduler) -> None:
    # Given a leader whose every sleep may last until its next look, and two slots committed ahead 3 s apart
    settings.SCHEDULER_LEASE_TTL_SECONDS = 3 * NEXT_LOOK_SECONDS
    settings.SCHEDULER_LEASE_RENEW_SECONDS = NEXT_LOOK_SECONDS
    beat.max_interval = NEXT_LOOK_SECONDS
    first, second = make_schedule("first", interval=3600), make_schedule("second", interval=3600)
    first_slot, second_slot = due_in(first, 2), due_in(second, 5)
    beat.tick()
    assert set(Execution.objects.values_list("status", flat=True)) == {Status.PENDING}

    # When the first slot's instant came and the leader ticks on as Celery runs it (tick, sleep what it returns)
    while dbclock.now() < first_slot:
        time.sleep(0.05)
    left = beat.tick()
    sent_first = Execution.objects.get(schedule=first)
    assert sent_first.status == Status.QUEUED and sent_first.enqueued_at is not None
    if left > 0:
        time.sleep(left)
    beat.max_interval = TICK_SLEEP  # (what this tick waits for after it sent is not this test's)
    beat.tick()

    # Then the sleep after it ended at the second instant (not at the leader's next look,
    # past the test's time limit), and the tick then sent the second slot, not before its instant
    row = Execution.objects.get(schedule=second)
    assert (row.scheduled_for, row.status) == (second_slot, Status.QUEUED)
    assert row.enqueued_at is not None and row.enqueued_at >= second_slot


def test_general_path__not_committed_before_its_instant(beat: LeaderScheduler) -> None:
    # Given schedules due within the window that need the general path: a cron, a capped one, a one-off that skips overlaps
    cron = make_schedule("cron", cron="*/5 * * * *")
    capped = make_schedule("capped", interval=3600, max_runs=3)
    one_off, _ = make_due_in("one-off", 20, name="one-off")
    Schedule.objects.filter(pk=one_off.pk).update(overlap=Schedule.Overlap.SKIP)
    for schedule in (cron, capped):
        due_in(schedule, 20)

    # When the leader ticks
    beat.tick()

    # Then nothing is committed: their instant decides
    assert beat.leadership.held
    assert not Execution.objects.filter(schedule__in=[cron, capped, one_off]).exists()


def _edit(schedule: Schedule) -> None:
    schedule.kwargs = {"changed": True}
    schedules.save(schedule)


def _trip_the_breaker(schedule: Schedule) -> None:
    Schedule.objects.filter(pk=schedule.pk).update(pause_after_failures=1)
    assert schedules.count_run(schedule.pk, status=Status.FAILED, error="boom", started_at=None)


CHANGES: dict[str, tuple[Callable[[Schedule], Any], bool]] = {
    # change: (what it does, whether the schedule still fires at the slot given back)
    "edit": (_edit, True),
    "pause": (lambda s: schedules.pause(s, "maintenance"), False),
    "turn off": (lambda s: schedules.set_enabled(s, False), False),
    "pause in bulk": (lambda s: schedules.pause_many([s.pk], "bulk"), False),
    "turn off in bulk": (lambda s: schedules.disable_many([s.pk]), False),
    "circuit breaker": (_trip_the_breaker, False),
}
TURN_OFFS = {"turn off", "turn off in bulk"}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("kind", KINDS)
def test_change__gives_the_slot_back(beat: LeaderScheduler, kind: str, change: str) -> None:
    # Given a slot committed ahead of its instant (a one-off's turned it off), while an operator had the schedule open
    schedule, slot = make_due_in(kind, 20)
    seen = Schedule.objects.get(pk=schedule.pk)
    committed_ahead(beat, schedule, slot)

    # When the schedule changes before the instant
    do, fires = CHANGES[change]
    do(seen)

    # Then the row is gone, and the slot is the schedule's again (or it has none, stopped)
    assert not Execution.objects.filter(schedule=schedule).exists()
    schedule.refresh_from_db()
    assert schedule.slots_committed == 0
    assert schedule.next_run_at == (slot if fires else None)
    # ... on, unless the change turned it off, and off by the operator then, not as done
    assert (schedule.enabled, schedule.disabled_reason) == (change not in TURN_OFFS, "")
    if fires:  # and the leader commits the slot again, as the schedule is now
        row = committed_ahead(beat, schedule, slot)
        assert row.kwargs == {"changed": True}


def test_interval_change__slot_follows_the_new_timing(beat: LeaderScheduler) -> None:
    # Given a slot committed ahead of its instant
    schedule = make_schedule("ahead", interval=3600)
    slot = due_in(schedule, 20)
    committed_ahead(beat, schedule, slot)

    # When its interval changes
    edited = Schedule.objects.get(pk=schedule.pk)
    edited.interval = 7200
    schedules.save(edited)

    # Then the old slot's row is gone and the next slot is the new timing's
    assert not Execution.objects.filter(schedule=schedule).exists()
    edited.refresh_from_db()
    assert edited.slots_committed == 0
    assert edited.next_run_at == edited.compute_next_run_at(now=dbclock.now())


def test_one_off_seen_done__an_edit_gives_the_slot_back_and_it_fires_as_edited(beat: LeaderScheduler) -> None:
    # Given a one-off committed ahead, which shows as turned off, done, until its instant
    schedule, slot = make_due_in("one-off", 20)
    committed_ahead(beat, schedule, slot)
    seen = Schedule.objects.get(pk=schedule.pk)
    assert not seen.enabled

    # When an operator edits it as it shows
    _edit(seen)

    # Then it is on again with its slot, and the leader commits that slot as edited
    schedule.refresh_from_db()
    assert (schedule.enabled, schedule.next_run_at, schedule.slots_committed) == (True, slot, 0)
    assert committed_ahead(beat, schedule, slot).kwargs == {"changed": True}


@pytest.mark.parametrize("kind", KINDS)
def test_delete__leaves_no_slot_to_send(beat: LeaderScheduler, kind: str) -> None:
    schedule, slot = make_due_in(kind, 20)
    committed_ahead(beat, schedule, slot)

    schedules.delete(Schedule.objects.get(pk=schedule.pk))

    assert not Execution.objects.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_shutdown__gives_the_slots_back(beat: LeaderScheduler, kind: str) -> None:
    # Given a slot committed ahead of its instant
    schedule, slot = make_due_in(kind, 20)
    committed_ahead(beat, schedule, slot)

    # When the leader stops
    beat.close()

    # Then the slot is the schedule's again, for whoever leads next (a one-off is on again)
    assert not Execution.objects.exists()
    schedule.refresh_from_db()
    assert (schedule.next_run_at, schedule.slots_committed, schedule.enabled) == (slot, 0, True)


@pytest.mark.parametrize("kind", KINDS)
def test_leader_gone__the_next_one_sends_the_slot_at_its_instant(
    settings: Any, beat_replica: BeatReplica, kind: str
) -> None:
    # Given a leader that committed a slot 2 s ahead, then lost its lease without stopping
    settings.SCHEDULER_COMMIT_AHEAD_SECONDS = AHEAD
    schedule, slot = make_due_in(kind, 2)
    gone = beat_replica(max_interval=TICK_SLEEP)
    committed_ahead(gone, schedule, slot)
    gone.leadership.release("for the test: it is gone")
    if gone._lock is not None:  # its sessions end with it
        gone._lock.close()

    # When another replica leads past the instant
    successor = beat_replica(max_interval=TICK_SLEEP)
    successor.tick()
    assert successor.leadership.held
    assert Execution.objects.get().status == Status.PENDING, "sent before its instant"
    while dbclock.now() < slot:
        time.sleep(0.05)
    successor.tick()

    # Then it sent the slot the first committed, once, and planned no second row for it
    row = Execution.objects.get()
    assert (row.scheduled_for, row.status) == (slot, Status.QUEUED)


@pytest.mark.parametrize("kind", KINDS)
def test_give_back_whose_transaction_outlasts_the_instant__every_message_names_a_row(
    beat: LeaderScheduler, redis_client: redis.Redis, kind: str
) -> None:
    # Given a slot committed ahead, its instant 2 s away, and a publisher that sends what is due once the instant passed
    schedule, slot = make_due_in(kind, 2)
    committed_ahead(beat, schedule, slot)

    def publish_after_the_instant() -> None:
        try:
            while dbclock.now() < slot:
                time.sleep(0.02)
            outbox.publish_pending(app)
        finally:
            connection.close()

    publisher = threading.Thread(target=publish_after_the_instant)

    # When a change gives the slot back in a transaction still open when the publisher reads after the instant
    with transaction.atomic():
        schedules.give_back_ahead([schedule.pk])
        publisher.start()
        # (on SQLite the publisher reads past this open transaction, then its mark waits for the commit)
        wait_until(lambda: redis_client.llen("celery") > 0 or dbclock.now() > slot + timedelta(seconds=1), timeout=10)
    publisher.join(timeout=30)
    assert not publisher.is_alive()

    # Then no message names a row the give-back deleted: the slot was sent as committed, or given back unsent
    messages = [json.loads(raw)["headers"][Execution.MESSAGE_HEADER] for raw in redis_client.lrange("celery", 0, -1)]
    rows = list(Execution.objects.filter(schedule=schedule).values_list("pk", "status"))
    given_back = (messages, rows) == ([], [])
    sent_once = len(rows) == 1 and rows[0][1] == Status.QUEUED and messages == [rows[0][0]]
    assert given_back or sent_once, f"messages for executions {messages}, rows {rows}"

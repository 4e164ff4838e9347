"""The stored shard count: seeded once, followed by every replica whatever its setting, changed by ``shards --set``, part of the fence."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from scheduler import dbclock, shards
from scheduler.beat import liveness, shard_keeper
from scheduler.beat.leadership import OneLease
from scheduler.beat.shard_keeper import ShardKeeper
from scheduler.exceptions import LeaseLost
from scheduler.models import AuditEvent, Execution, Schedule, ShardLayout
from scheduler.ops import resharding
from scheduler.owners import leases, schedules
from tests.integration.command_support import refused, run
from tests.support.replicas import BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)


def _due_schedules(count: int) -> list[Schedule]:
    """``count`` every-minute schedules with a slot due now."""
    created = [schedules.create(name=f"s{n}", task="scheduler.echo", interval=60) for n in range(count)]
    Schedule.objects.update(next_run_at=dbclock.now().replace(second=0, microsecond=0))
    return created


# --- the stored count ----------------------------------------------------------------


def test_follow_count__the_first_replica_stores_its_setting_and_the_others_follow_it(settings: Any) -> None:
    # Given no stored count, and a replica started with SCHEDULER_SHARDS = 4
    settings.SCHEDULER_SHARDS = 4
    assert shards.stored() is None and shards.count() == 4
    # When it reads the count, Then it stores its own
    assert shard_keeper.follow_count("host-a") == 4
    layout = ShardLayout.objects.get()
    assert (layout.shards, layout.changed_by) == (4, "host-a")
    # When a replica started with 8 reads it, Then it follows the stored 4, and so does every other process
    settings.SCHEDULER_SHARDS = 8
    assert shard_keeper.follow_count("host-b") == 4
    assert shards.count() == 4 and ShardLayout.objects.get().changed_by == "host-a"


def test_schedules_saved_go_to_the_shard_of_the_stored_count(settings: Any) -> None:
    settings.SCHEDULER_SHARDS = 2
    resharding.store_count(8, by="test")
    created = [schedules.create(name=f"s{n}", task="scheduler.echo", interval=60) for n in range(10)]
    assert all(schedule.shard == schedule.pk % 8 for schedule in created)


# --- the fence ----------------------------------------------------------------------


def test_fence__each_kind_of_lease_fences_only_under_its_count() -> None:
    # Given the one lease and a shard lease, both held
    single = leases.acquire("beat", "host-a", ttl=10)
    shard = leases.acquire("beat:0", "host-b", ttl=10)
    assert single is not None and shard is not None

    def fences(handle: leases.LeaseHandle) -> bool:
        try:
            with transaction.atomic():
                leases.assert_held(handle)
            return True
        except LeaseLost as exc:
            assert exc.names == (handle.name,)
            return False

    # When the count is 1, Then only the one lease fences
    resharding.store_count(1, by="test")
    assert (fences(single), fences(shard)) == (True, False)
    # When it is 4, Then only the shard lease does
    resharding.store_count(4, by="test")
    assert (fences(single), fences(shard)) == (False, True)
    # And a lease of no beat kind is not concerned
    other = leases.acquire("other", "host-c", ttl=10)
    assert other is not None and fences(other)


def test_store_count__waits_for_a_commit_in_flight_and_later_commits_see_it(lease: leases.LeaseHandle) -> None:
    # Given the count 1 and a dispatch commit in flight under the one lease
    resharding.store_count(1, by="test")
    fenced, release, changed = threading.Event(), threading.Event(), threading.Event()

    def commit() -> None:
        try:
            with transaction.atomic():
                leases.assert_held(lease)
                fenced.set()
                release.wait(10)
        finally:
            connections.close_all()

    def change() -> None:
        try:
            resharding.store_count(4, by="test")
            changed.set()
        finally:
            connections.close_all()

    committing = threading.Thread(target=commit)
    committing.start()
    assert fenced.wait(10)
    # When the count is changed meanwhile
    changing = threading.Thread(target=change)
    changing.start()
    # Then the change waits for the commit (the count is part of its fence) ...
    assert not changed.wait(1.0), "the count changed under a commit in flight"
    release.set()
    committing.join(10)
    assert changed.wait(10), "the change did not go through once the commit ended"
    changing.join(10)
    # ... and a commit under the one lease after it is refused
    with pytest.raises(LeaseLost), transaction.atomic():
        leases.assert_held(lease)


# --- a replica follows the count ------------------------------------------------------


def test_beat__one_lease_to_shards_and_back_on_its_next_tick(settings: Any, beat_replica: BeatReplica) -> None:
    # Given a replica started unsharded, leading under the one lease, and due schedules
    settings.SCHEDULER_SHARDS = 1
    schedules = _due_schedules(4)
    scheduler = beat_replica()
    scheduler.tick()
    assert isinstance(scheduler.leadership, OneLease) and scheduler.leadership.held
    assert {row.lease_name for row in Execution.objects.all()} == {"beat"}

    # When the count is set to 4 and the schedules moved
    resharding.store_count(4, by="test")
    assert resharding.move_schedules(4) == 3
    scheduler.tick()
    # Then on its next tick it gave the one lease up and holds every shard (it is alone)
    assert isinstance(scheduler.leadership, ShardKeeper) and not leases.current("beat").is_held
    assert sorted(scheduler.leadership.held) == [0, 1, 2, 3]
    # ... and dispatches under each schedule's shard lease
    Execution.objects.all().delete()
    _make_due(schedules)
    scheduler.tick()
    rows = {row.schedule_id: row.lease_name for row in Execution.objects.all()}
    assert rows == {schedule.pk: f"beat:{schedule.pk % 4}" for schedule in schedules}

    # When the count goes back to 1
    resharding.store_count(1, by="test")
    scheduler.tick()
    # Then it released every shard and leads under the one lease again
    assert isinstance(scheduler.leadership, OneLease) and scheduler.leadership.held
    view = [leases.current(shards.lease_name(shard)) for shard in range(4)]
    assert not any(state.is_held for state in view)
    Execution.objects.all().delete()
    _make_due(schedules)
    scheduler.tick()
    assert {row.lease_name for row in Execution.objects.all()} == {"beat"}
    assert Execution.objects.count() == len(schedules)


def _make_due(schedules: list[Schedule]) -> None:
    """Point the schedules at their latest slot again (its execution deleted), so exactly one slot is due."""
    Schedule.objects.filter(pk__in=[s.pk for s in schedules]).update(
        next_run_at=dbclock.now().replace(second=0, microsecond=0)
    )


def test_beat__replicas_with_different_settings_follow_the_stored_count(
    settings: Any, beat_replica: BeatReplica
) -> None:
    # Given a replica started with 4 shards, which stores the count
    settings.SCHEDULER_SHARDS = 4
    first = beat_replica()
    first.tick()
    # When a second replica starts with 8
    settings.SCHEDULER_SHARDS = 8
    second = beat_replica()
    for _ in range(3):
        second.tick()
        first.tick()
    # Then both follow 4: between them they hold exactly shards 0-3, each once
    assert first.shard_count == second.shard_count == 4
    held = sorted([*first.leadership.held, *second.leadership.held])
    assert held == [0, 1, 2, 3]
    assert held == sorted(
        [
            *shards.wanted(first.instance_id, {first.instance_id, second.instance_id}, 4),
            *shards.wanted(second.instance_id, {first.instance_id, second.instance_id}, 4),
        ]
    )


# --- manage.py shards --set --------------------------------------------------------------


def test_set__stores_the_count_and_moves_the_schedules_with_no_replica_running(settings: Any) -> None:
    # Given schedules saved under 4 shards (the count stored)
    settings.SCHEDULER_SHARDS = 4
    resharding.store_count(4, by="test")
    created = [schedules.create(name=f"s{n}", task="scheduler.echo", interval=60) for n in range(12)]
    to_move = sum(1 for schedule in created if schedule.shard != schedule.pk % 8)

    # When a dry run asks, Then nothing changes
    dry = json.loads(run("shards", "--set", "8", "--dry-run", "--json"))
    assert dry == {"previous": 4, "shards": 8, "moved": to_move, "settled": None, "dry_run": True}
    assert shards.stored() == 4 and sorted(Schedule.objects.values_list("shard", flat=True)) == sorted(
        s.shard for s in created
    )

    # When the count is set to 8
    text = run("shards", "--set", "8")
    # Then it is stored, every schedule is in shard id % 8, and the change is audited
    assert shards.stored() == 8 and ShardLayout.objects.get().previous == 4
    assert all(schedule.shard == schedule.pk % 8 for schedule in Schedule.objects.all())
    assert (
        "shard count 4 -> 8" in text
        and "no beat replica live" in text
        and f"moved {to_move} schedules into shard id % 8" in text
    )
    event = AuditEvent.objects.get(action="set_shards")
    assert event.changes == {"shards": 8, "previous": 4, "moved": to_move, "settled": None, "state": "completed"}
    # And the report says where the count comes from, and that the setting here differs
    report = json.loads(run("shards", "--json"))
    assert (report["shards"], report["stored"], report["configured"], report["misplaced"]) == (8, 8, 4, 0)
    assert "shards: 8 (stored; SCHEDULER_SHARDS here is 4, which only seeds an empty table)" in run("shards")

    # When set back to 1, Then every schedule is in shard 0
    assert json.loads(run("shards", "--set", "1", "--json"))["previous"] == 8
    assert set(Schedule.objects.values_list("shard", flat=True)) == {0}


def test_set__refuses_a_count_out_of_range_and_set_with_assign(settings: Any) -> None:
    settings.SCHEDULER_SHARDS = 4
    assert "--set takes a shard count from 1 to 1024, got 0" in refused("shards", "--set", "0")
    assert "--set takes a shard count from 1 to 1024, got 2000" in refused("shards", "--set", "2000")
    assert "not allowed with argument" in refused("shards", "--set", "8", "--assign")
    assert shards.stored() is None


def test_set__waits_for_live_replicas_to_hold_the_new_shards_before_moving(
    settings: Any, beat_replica: BeatReplica
) -> None:
    # Given a live replica holding the 2 stored shards, and schedules in them
    settings.SCHEDULER_SHARDS = 2
    scheduler = beat_replica()
    scheduler.tick()
    assert sorted(scheduler.leadership.held) == [0, 1]
    created = [schedules.create(name=f"s{n}", task="scheduler.echo", interval=60) for n in range(8)]
    ticking = threading.Event()

    def tick() -> None:
        try:
            while not ticking.is_set():
                scheduler.tick()
                ticking.wait(0.1)
        finally:
            connections.close_all()

    # When the count is set to 4 while the replica ticks
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        change = resharding.change_count(4, by="test", settle_seconds=10)
    finally:
        ticking.set()
        ticker.join(10)
    # Then it waited for the replica to hold all 4, then moved the schedules
    assert change.settled is True and change.previous == 2
    assert change.moved == sum(1 for schedule in created if schedule.pk % 4 != schedule.pk % 2)
    assert sorted(scheduler.leadership.held) == [0, 1, 2, 3]


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="PostgreSQL only: no LISTEN on SQLite, replicas read the count on their next tick",
)
def test_set__wakes_a_waiting_replica_at_once() -> None:
    # Given a follower waiting for the one lease's release (as it sleeps between ticks)
    lock = liveness.InstanceLock("host-a")
    try:
        assert lock.try_acquire()
        lock._listening()  # listening before the change, as a replica that waited before
        outcome: list[Any] = []
        waiter = threading.Thread(target=lambda: outcome.append(lock.wait_for(None, "beat", timeout=10)))
        waiter.start()
        # When the count changes
        resharding.store_count(4, by="test")
        waiter.join(5)
        # Then the wait ended, as for a release
        assert outcome == [liveness.Wait.RELEASED]
    finally:
        lock.close()

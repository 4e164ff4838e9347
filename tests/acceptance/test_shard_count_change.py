"""Changing the shard count while real replicas run: by a rolling restart with another ``SCHEDULER_SHARDS``, and by ``shards --set``.

Every schedule fires every second. Throughout, no slot may wait longer than
twice the lease TTL for its row (SPEC guarantee 11), no slot may have two
rows or none, and no schedule may be committed under two kinds of fence at
once. The replicas run with a 6 s lease (renewed every 2 s), so that the
mixed state of the rolling restart, held for longer than 2 x TTL, stays short.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from datetime import datetime

import pytest
import redis
from django.db.models import Max

from scheduler import dbclock, shards
from scheduler.models import Execution, Instance, Schedule
from scheduler.owners import leases
from tests.acceptance.test_beat_replicas import Start
from tests.acceptance.test_sharded_beat import holders, instance_pid, make_schedules
from tests.acceptance.test_sharded_failover import assert_no_duplicate_and_no_gap, assert_sent
from tests.integration.command_support import run
from tests.support.processes import CeleryProcess, wait_until
from tests.support.stranding_beat import stranded_by_own_settings

pytestmark = pytest.mark.django_db(transaction=True)

TTL = 6.0
LEASE = {"lease_ttl_seconds": TTL, "lease_renew_seconds": 2}
#: The longest a slot may wait for its row: twice the lease TTL.
BOUND = 2 * TTL
SCHEDULES = {"postgresql": 300, "sqlite": 60}
#: A replica's start (imports, the first database round trip) before it registers.
START_SECONDS = 30.0


def start_beat(start: Start, name: str, count: int, *, wrapper: list[str] | None = None) -> tuple[CeleryProcess, str]:
    """Start a replica with ``SCHEDULER_SHARDS = count``; return it and its instance id once it registered."""
    beat = start("beat", name, shards=count, wrapper=wrapper, **LEASE)

    def registered() -> str | None:
        ids = Instance.objects.filter(role=Instance.Role.BEAT).values_list("instance_id", flat=True)
        return next((instance_id for instance_id in ids if instance_pid(instance_id) == beat.pid), None)

    instance_id = wait_until(registered, timeout=START_SECONDS, interval=0.1)
    assert instance_id, f"{name} did not register; its log tail:\n{beat.log()[-3000:]}"
    return beat, str(instance_id)


def two_replicas_on_4_shards(
    start: Start, settings: object, db_vendor: str
) -> tuple[list[Schedule], tuple[CeleryProcess, str], tuple[CeleryProcess, str]]:
    """Spread every-second schedules over 4 shards; start replicas a and b on 4; return them once they hold every shard."""
    settings.SCHEDULER_SHARDS = 4  # type: ignore[attr-defined]
    schedules = make_schedules(SCHEDULES[db_vendor])
    a = start_beat(start, "a", 4)
    b = start_beat(start, "b", 4)
    assert wait_until(lambda: all_held_by(4, [a[0], b[0]]), timeout=START_SECONDS, interval=0.1), (
        f"never settled: {holders(16)}"
    )
    return schedules, a, b


def all_held_by(count: int, beats: list[CeleryProcess]) -> bool:
    """Every shard of ``count`` is held, each by one of ``beats``, and no shard past it is."""
    held = holders(max(count, 16))
    pids = {beat.pid for beat in beats}
    return sorted(held) == sorted(shards.lease_names(count)) and all(
        instance_pid(holder) in pids for holder, _ in held.values()
    )


def assert_on_time(schedules: list[Schedule], *, since: datetime) -> None:
    """No slot from ``since`` on waited longer than ``BOUND`` for its row (its commit, on the beat's clock)."""
    rows = Execution.objects.filter(schedule__in=schedules, scheduled_for__gte=since).values_list(
        "schedule__name", "scheduled_for", "created_at"
    )
    late = sorted(((created - slot).total_seconds(), name, slot) for name, slot, created in rows)[-5:]
    assert late, "no slot fired in the window"
    worst = late[-1][0]
    print(f"longest wait of a slot for its row: {worst:.2f}s (bound {BOUND}s)")
    assert worst <= BOUND, f"slots waited longer than {BOUND}s for their row, the latest: {late}"


def settle_window(schedules: list[Schedule]) -> None:
    """Wait until every slot up to now is committed, so stopping the replicas cuts no slot short."""
    ended = dbclock.now()
    assert wait_until(
        lambda: not Schedule.objects.filter(pk__in=[s.pk for s in schedules], next_run_at__lt=ended).exists(),
        timeout=3 * BOUND,
        interval=0.1,
    ), "the replicas did not catch up with the window's slots"


def test_rolling_restart_with_another_shard_count__every_shard_stays_owned(
    celery_processes: Start, settings: object, db_vendor: str, redis_client: redis.Redis
) -> None:
    # Given every-second schedules spread over 4 shards and two replicas on 4
    schedules, (a, a_id), (b, b_id) = two_replicas_on_4_shards(celery_processes, settings, db_vendor)
    started = dbclock.now()

    # When b is restarted with SCHEDULER_SHARDS = 8, as a rolling change
    # would, with an instance id for which each replica's own count would
    # leave a shard with schedules wanted by nobody
    b.stop()
    b, b_id = start_beat(
        celery_processes, "b8", 8, wrapper=[sys.executable, "-m", "tests.support.stranding_beat", a_id, "4", "8"]
    )
    stranded = stranded_by_own_settings({a_id: 4, b_id: 8}, 4)
    print(f"{a_id} on 4, {b_id} on 8: shards {sorted(stranded)} wanted by nobody on their own settings")
    assert stranded
    # ... and the two run so for longer than twice the TTL
    time.sleep(BOUND + 4)
    mixed = holders(16)

    # ... and then a is restarted with 8 too
    a.stop()
    a, a_id = start_beat(celery_processes, "a-last", 8)
    time.sleep(4)
    settle_window(schedules)
    after = holders(16)
    logs = b.log()
    for beat in (a, b):
        beat.stop()

    # Then every shard with schedules stayed owned: no slot waited longer than 2 x TTL, none twice, none lost
    assert_on_time(schedules, since=started)
    assert_no_duplicate_and_no_gap(schedules, since=started)
    assert_sent(redis_client)
    # ... because both replicas followed the stored count, 4, whatever their setting
    assert shards.stored() == 4
    assert sorted(mixed) == sorted(after) == shards.lease_names(4), (mixed, after)
    assert "SCHEDULER_SHARDS is 8 here but the stored shard count is 4" in logs


def fence_switches(schedule: Schedule) -> int:
    """How often the kind of lease (the one ``beat`` or a shard's) changes along a schedule's rows, in commit order."""
    kinds = [
        name == "beat"
        for name in Execution.objects.filter(schedule=schedule)
        .order_by("created_at", "scheduled_for")
        .values_list("lease_name", flat=True)
    ]
    return sum(1 for before, after in zip(kinds, kinds[1:]) if before != after)


def test_set_while_the_replicas_run__4_to_8_to_2_to_1_to_4__no_gap_and_one_fence_at_a_time(
    celery_processes: Start, settings: object, db_vendor: str, redis_client: redis.Redis
) -> None:
    # Given every-second schedules spread over 4 shards and two replicas on 4
    schedules, (a, _), (b, _) = two_replicas_on_4_shards(celery_processes, settings, db_vendor)
    started = dbclock.now()
    time.sleep(2)

    # When the count is changed with the command, one step after the other, while both run
    for count in (8, 2, 1, 4):
        took = time.monotonic()
        change = json.loads(run("shards", "--set", str(count), "--json"))
        print(f"shards --set {count} in {time.monotonic() - took:.2f}s: {change}")
        # Then the replicas held the new count's leases (the one lease for 1) before the schedules moved ...
        assert change["settled"] is True, change
        if count == 1:
            state = leases.current("beat")
            assert state.is_held and instance_pid(state.holder) in (a.pid, b.pid) and not holders(16)
        else:
            assert all_held_by(count, [a, b]), holders(16)
            assert not leases.current("beat").is_held
            per_replica = Counter(instance_pid(holder) for holder, _ in holders(count).values())
            assert set(per_replica) == {a.pid, b.pid}, per_replica
        # ... and every schedule is in shard id % N
        misplaced = [pk for pk, shard in Schedule.objects.values_list("pk", "shard") if shard != pk % count]
        assert not misplaced, f"{len(misplaced)} schedules not in shard id % {count}"
        time.sleep(3)
    settle_window(schedules)
    for beat in (a, b):
        beat.stop()

    # Then no slot waited longer than 2 x TTL, none has two rows, none was lost
    assert_on_time(schedules, since=started)
    assert_no_duplicate_and_no_gap(schedules, since=started)
    assert_sent(redis_client)
    # ... and every schedule was committed under one kind of fence at a time:
    # shard leases, then the one lease (at 1), then shard leases again
    switches = {schedule.name: fence_switches(schedule) for schedule in schedules}
    assert set(switches.values()) == {2}, {name: n for name, n in switches.items() if n != 2}
    last = Execution.objects.filter(schedule__in=schedules).aggregate(last=Max("scheduled_for"))["last"]
    assert last is not None and last > started

"""Active-active beat: real replicas sharing ``SCHEDULER_SHARDS`` shards, each fenced by its own lease.

PostgreSQL runs the issue's sizes (5 replicas, 64 shards, 1,000 every-second
schedules, 60 s); SQLite, whose one write lock every replica shares, runs
the same checks at a size it can carry on two cores.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import redis
from django.db.models import Count, Max, Min

from scheduler import dbclock, shards
from scheduler.models import Execution, Lease, Schedule
from scheduler.owners import schedules
from tests.acceptance.test_beat_replicas import Start, assert_every_slot_once
from tests.support.processes import CeleryProcess, pid_of, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@dataclass(frozen=True)
class Size:
    replicas: int
    shards: int
    schedules: int
    seconds: float


STEADY = {
    "postgresql": Size(replicas=5, shards=64, schedules=1000, seconds=30),
    # 6 schedules a shard: with 100, four shards carried 7, and a replica holding 6 of 16 shards, its
    # fair share, could hold all four and dispatch 20 % over the mean by the ids alone.
    "sqlite": Size(replicas=3, shards=16, schedules=96, seconds=20),
}
#: Dispatches or shards per replica may differ from the mean by this much.
BALANCE = 0.20


def make_schedules(count: int) -> list[Schedule]:
    """``count`` every-second schedules, spread over the shards by their ids."""
    created = []
    for index in range(count):
        schedule = Schedule(name=f"every-1s-{index}", task="tests.record", interval=1, kwargs={"label": f"s{index}"})
        schedules.save(schedule)
        created.append(schedule)
    return created


def sharded_replicas(
    start: Start, settings: object, size: Size, replicas: int
) -> tuple[list[Schedule], list[CeleryProcess]]:
    """Store ``size.shards`` as the shard count, make its every-second schedules, and start ``replicas`` beats."""
    settings.SCHEDULER_SHARDS = size.shards  # type: ignore[attr-defined]
    made = make_schedules(size.schedules)
    return made, [start("beat", f"beat{index}", shards=size.shards) for index in range(replicas)]


def instance_pid(instance_id: str) -> int:
    return pid_of(instance_id)


def holders(count: int) -> dict[str, tuple[str, int]]:
    """{shard lease name: (holder, token)} for the shards held unexpired right now."""
    now = dbclock.now()
    rows = Lease.objects.filter(name__in=shards.lease_names(count), expires_at__gt=now).exclude(holder="")
    return {row.name: (row.holder, row.token) for row in rows}


def within(counts: list[int], share: float) -> bool:
    mean = sum(counts) / len(counts)
    return all(abs(count - mean) <= share * mean for count in counts)


def balanced(count: int, beats: list[CeleryProcess]) -> bool:
    """Every shard held, each by one of ``beats``, and their loads within ``BALANCE`` of even."""
    held = holders(count)
    if len(held) != count:
        return False
    loads = Counter(instance_pid(holder) for holder, _ in held.values())
    pids = {beat.pid for beat in beats}
    if set(loads) != pids:
        return False
    return within([loads[pid] for pid in pids], BALANCE)


def messages_per_execution(client: redis.Redis) -> Counter[int]:
    """How many messages the default queue holds for each execution (no worker consumes it here)."""
    sent: Counter[int] = Counter()
    for raw in client.lrange("celery", 0, -1):
        sent[int(json.loads(raw)["headers"]["execution_id"])] += 1
    return sent


def test_steady_state__every_slot_once_spread_evenly_no_shard_changes_hands(
    celery_processes: Start, settings: object, db_vendor: str, redis_client: redis.Redis
) -> None:
    size = STEADY[db_vendor]
    # Given every-second schedules and replicas sharing the shards
    schedules, beats = sharded_replicas(celery_processes, settings, size, size.replicas)
    assert len({schedule.shard for schedule in schedules}) == size.shards
    assert wait_until(lambda: balanced(size.shards, beats), timeout=60, interval=0.25), (
        f"the shards never settled over the replicas: {Counter(h for h, _ in holders(size.shards).values())}"
    )

    # When they run for the whole window
    before, started = holders(size.shards), dbclock.now()
    time.sleep(size.seconds)
    ended = dbclock.now()
    # (every slot of the window committed before the owners are read again
    # and the replicas stopped: a stopped replica's shards pass to others)
    assert wait_until(lambda: not Schedule.objects.filter(next_run_at__lt=ended).exists(), timeout=30, interval=0.1), (
        "the replicas did not catch up with the window's slots"
    )
    # (and published: a row is sent after its commit, so on a loaded machine the last ones may still wait)
    window_pending = Execution.objects.filter(scheduled_for__lt=ended, status=Execution.Status.PENDING)
    assert wait_until(lambda: not window_pending.exists(), timeout=30, interval=0.1), "the window was not all sent"
    after = holders(size.shards)
    for beat in beats:
        beat.stop()

    # Then no shard changed hands (same holder, same token) ...
    assert after == before, (
        f"shards changed hands: { {n: (before.get(n), after.get(n)) for n in before if before.get(n) != after.get(n)} }"
    )
    # ... every slot has exactly one row, committed under its shard's lease ...
    assert_every_slot_once(schedules)
    window = Execution.objects.filter(scheduled_for__gte=started, scheduled_for__lt=ended)
    mismatched = [
        row
        for row in window.values("lease_name", "lease_token", "dispatcher", "schedule__shard")
        if before[row["lease_name"]] != (row["dispatcher"], row["lease_token"])
        or row["lease_name"] != shards.lease_name(row["schedule__shard"])
    ]
    if mismatched:
        name = mismatched[0]["lease_name"]
        by_token = list(
            window.filter(lease_name=name)
            .values("lease_token", "dispatcher")
            .annotate(rows=Count("id"), first=Min("scheduled_for"), last=Max("scheduled_for"))
        )
        pytest.fail(f"{len(mismatched)} rows not under their shard's lease; {name} was {before[name]}: {by_token}")
    expected = size.schedules * int(size.seconds) * 0.9
    assert window.count() >= expected, f"only {window.count()} executions in the window, expected about {expected:.0f}"
    # ... and sent once (a replica stopped between its push and its commit
    # leaves its batch to be sent again, and claimed once: not in the window)
    sent = messages_per_execution(redis_client)
    in_window = set(window.values_list("id", flat=True))
    assert not {execution for execution in in_window if sent[execution] != 1}, "window executions not sent exactly once"
    assert set(Execution.objects.exclude(status=Execution.Status.PENDING).values_list("id", flat=True)) <= set(sent)
    # ... and the dispatches per replica are within 20 % of the mean
    per_replica = dict(window.values_list("dispatcher").annotate(n=Count("id")).values_list("dispatcher", "n"))
    assert len(per_replica) == size.replicas and within(list(per_replica.values()), BALANCE), per_replica

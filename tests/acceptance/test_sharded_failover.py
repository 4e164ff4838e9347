"""Sharded beat failover with real replicas: joins and leaves rebalance, a kill is taken over, a freeze is fenced.

The issue's acceptance for ``SCHEDULER_SHARDS > 1`` beyond the steady state
(``test_sharded_beat``): replicas joining one by one and leaving by SIGTERM
and SIGKILL without a duplicate or a gap, the balance back within 20 % after
each change, a SIGKILLed replica's shards taken within the issue's bound,
and a replica frozen past its TTL fenced off and taken back in once resumed.
No worker runs: the rows and the messages in the broker's default queue are
checked, as in the steady-state test.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from datetime import datetime

import pytest
import redis
from django.db.models import Count, Max, Min

from scheduler import dbclock, shards
from scheduler.conf import Defaults
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.acceptance.test_beat_replicas import Start, assert_every_slot_once
from tests.acceptance.test_sharded_beat import (
    Size,
    balanced,
    holders,
    instance_pid,
    messages_per_execution,
    sharded_replicas,
)
from tests.support.processes import CeleryProcess, freeze_outside_a_write, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: ``seconds``: how long all five replicas run together before the leaves.
#: SQLite has 20 shards, not 16: 16 over 5 replicas is at best 4 against a
#: mean of 3.2, 25 % off, so no placement could be within 20 % of even.
JOIN_LEAVE = {
    "postgresql": Size(replicas=5, shards=64, schedules=300, seconds=5),
    "sqlite": Size(replicas=5, shards=20, schedules=100, seconds=5),
}
#: ``seconds``: how long the replicas run before one is frozen.
FREEZE = {
    "postgresql": Size(replicas=3, shards=64, schedules=300, seconds=3),
    "sqlite": Size(replicas=3, shards=20, schedules=100, seconds=3),
}
TTL = Defaults.LEASE_TTL_SECONDS  # the replicas run with the default lease
#: The issue's bound on rebalancing after a join or a leave.
REBALANCE_SECONDS = 15.0
#: A replica's start (imports, the first database round trip) before it joins.
START_SECONDS = 30.0
#: The issue's bound on taking a SIGKILLed replica's shards over.
#: SQLite: the TTL plus one tick, plus 0.25 s for reading the database clock
#: before the kill and the acquired_at after it on a busy two-core machine.
KILL_TAKEOVER_SECONDS = {"postgresql": 1.5, "sqlite": TTL + 1.0 + 0.25}


def held_by(count: int, beat: CeleryProcess) -> dict[str, int]:
    """{shard lease name: token} of the shards ``beat`` holds unexpired now."""
    return {name: token for name, (holder, token) in holders(count).items() if instance_pid(holder) == beat.pid}


def taken_from(count: int, names: dict[str, int], beat: CeleryProcess) -> bool:
    """Whether every shard of ``names`` is held unexpired by another replica than ``beat``."""
    held = holders(count)
    return all(name in held and instance_pid(held[name][0]) != beat.pid for name in names)


def acquired_at(names: dict[str, int]) -> dict[str, datetime]:
    return {name: leases.current(name).acquired_at for name in names}  # type: ignore[misc]


def join(start: Start, name: str, count: int, beats: list[CeleryProcess]) -> CeleryProcess:
    """Start one more replica and wait for the shards to spread over all of them."""
    beat = start("beat", name, shards=count)
    beat.wait_for_log(r"beat replica \S+ started", timeout=START_SECONDS)
    beats.append(beat)
    assert wait_until(lambda: balanced(count, beats), timeout=REBALANCE_SECONDS, interval=0.1), (
        f"{name} joined: not back within 20 % of even in {REBALANCE_SECONDS}s: {loads(count)}"
    )
    return beat


def loads(count: int) -> Counter[int]:
    """Shards held per replica pid (for failure messages)."""
    return Counter(instance_pid(holder) for holder, _ in holders(count).values())


def assert_no_duplicate_and_no_gap(schedules: list[Schedule], *, since: datetime) -> None:
    """Each schedule: one row per slot, contiguous from its first, none missed, still firing after ``since``."""
    assert_every_slot_once(schedules)
    assert not Execution.objects.filter(status=Execution.Status.MISSED).exists(), "slots recorded missed"
    stale = Schedule.objects.filter(pk__in=[s.pk for s in schedules]).annotate(last=Max("executions__scheduled_for"))
    behind = [s.name for s in stale if s.last is None or s.last < since]
    assert not behind, f"{len(behind)} schedules stopped firing before {since}, e.g. {behind[:3]}"


def assert_fenced_rows() -> None:
    """Every row is committed under its own shard's lease, and each (lease, token) names one dispatcher."""
    wrong_shard = [
        row
        for row in Execution.objects.values("id", "lease_name", "schedule__shard")
        if row["lease_name"] != shards.lease_name(row["schedule__shard"])
    ]
    assert not wrong_shard, f"{len(wrong_shard)} rows under another shard's lease, e.g. {wrong_shard[:3]}"
    shared = list(
        Execution.objects.values("lease_name", "lease_token")
        .annotate(n=Count("dispatcher", distinct=True))
        .filter(n__gt=1)
    )
    assert not shared, f"one (lease, token) used by several replicas: {shared[:3]}"


def all_fire_then_stop(beats: list[CeleryProcess], schedules: list[Schedule], *, after: str) -> datetime:
    """Wait until every one of ``schedules`` has sent a slot after now, then stop ``beats``; return that now.

    Sent, not only committed: a stopping leader gives back the slots it committed ahead of their instant.
    """
    moment = dbclock.now()

    def all_fired() -> bool:
        sent = Execution.objects.filter(scheduled_for__gt=moment, enqueued_at__isnull=False)
        fired = sent.values("schedule").distinct().count()
        return fired == len(schedules)

    assert wait_until(all_fired, timeout=REBALANCE_SECONDS, interval=0.25), f"not every schedule fired after {after}"
    for beat in beats:
        beat.stop()
    return moment


def assert_sent(client: redis.Redis) -> None:
    """Every row past pending has its message, and every message names a row.

    A message may be sent twice (SPEC: duplicate deliveries are claimed
    once, so no slot runs twice): a publisher stopped or frozen between its
    push and its mark, or the broker check's re-send on a broker whose run
    is not confirmed yet. How many is printed, not bounded.
    """
    sent = messages_per_execution(client)
    ids = set(Execution.objects.values_list("id", flat=True))
    assert set(sent) <= ids, f"messages for unknown executions: {sorted(set(sent) - ids)[:5]}"
    unsent = Execution.objects.exclude(status=Execution.Status.PENDING).exclude(id__in=list(sent))
    assert not unsent.exists(), f"{unsent.count()} executions marked sent without a message"
    print(f"executions sent more than once: {sum(1 for n in sent.values() if n > 1)} of {len(sent)}")


def test_join_and_leave__no_duplicate_no_gap_balanced_after_each_change(
    celery_processes: Start, settings: object, db_vendor: str, redis_client: redis.Redis
) -> None:
    size = JOIN_LEAVE[db_vendor]
    # Given every-second schedules and two replicas sharing the shards
    schedules, beats = sharded_replicas(celery_processes, settings, size, 2)
    assert wait_until(lambda: balanced(size.shards, beats), timeout=60, interval=0.25), (
        f"two replicas never settled: {loads(size.shards)}"
    )

    # When three more join one by one (each waits for the balance, within 15 s) ...
    for index in range(2, size.replicas):
        join(celery_processes, f"beat{index}", size.shards, beats)
    time.sleep(size.seconds)

    # ... then two leave by SIGTERM, one after the other ...
    for beat in beats[:2]:
        beat.send(signal.SIGTERM)
        live = [other for other in beats if other.alive() and other is not beat]
        assert wait_until(
            lambda: not beat.alive() and balanced(size.shards, live), timeout=REBALANCE_SECONDS, interval=0.1
        ), (
            f"{beat.name} SIGTERMed (alive: {beat.alive()}): not back within 20 % in {REBALANCE_SECONDS}s: {loads(size.shards)}"
        )
    # ... and one is SIGKILLed
    live = beats[3:]
    victim = beats[2]
    victims_shards = held_by(size.shards, victim)
    assert victims_shards, f"{victim.name} held no shard to take over"
    killed_at = dbclock.now()
    victim.send(signal.SIGKILL)
    bound = KILL_TAKEOVER_SECONDS[db_vendor]
    assert wait_until(lambda: taken_from(size.shards, victims_shards, victim), timeout=bound + 10, interval=0.02), (
        f"the SIGKILLed replica's shards were not taken over: {loads(size.shards)}"
    )
    gaps = {name: (at - killed_at).total_seconds() for name, at in acquired_at(victims_shards).items()}
    print(
        f"SIGKILL takeover of {len(gaps)} shards on {db_vendor}: max {max(gaps.values()):.3f}s, "
        f"min {min(gaps.values()):.3f}s (bound {bound}s)"
    )
    assert max(gaps.values()) <= bound, (
        f"takeover gap per shard over {bound}s: {sorted(gaps.items(), key=lambda g: -g[1])[:5]}"
    )
    assert wait_until(lambda: balanced(size.shards, live), timeout=REBALANCE_SECONDS, interval=0.1), (
        f"{victim.name} SIGKILLed: not back within 20 % in {REBALANCE_SECONDS}s: {loads(size.shards)}"
    )
    # The survivors fire every schedule again, the killed one's included
    settled = all_fire_then_stop(beats, schedules, after="the last change")

    # Then over the whole run: no slot twice, none skipped, every row under its shard's lease
    assert_no_duplicate_and_no_gap(schedules, since=settled)
    assert_fenced_rows()
    assert_sent(redis_client)


def test_freeze__taken_after_ttl_old_tokens_fenced_and_rejoins(
    celery_processes: Start, settings: object, db_vendor: str, redis_client: redis.Redis
) -> None:
    size = FREEZE[db_vendor]
    # Given every-second schedules and three replicas sharing the shards
    schedules, beats = sharded_replicas(celery_processes, settings, size, size.replicas)
    assert wait_until(lambda: balanced(size.shards, beats), timeout=60, interval=0.25), (
        f"the replicas never settled: {loads(size.shards)}"
    )
    time.sleep(size.seconds)
    frozen, others = beats[0], beats[1:]

    # When one is frozen past the TTL
    freeze_outside_a_write(frozen)
    frozen_at = dbclock.now()
    old = held_by(size.shards, frozen)
    assert old, f"{frozen.name} held no shard when frozen"
    expiry = {name: leases.current(name).expires_at for name in old}

    # Then the others take its shards, but only once its leases expired
    assert wait_until(lambda: taken_from(size.shards, old, frozen), timeout=TTL + REBALANCE_SECONDS, interval=0.05), (
        f"the frozen replica's shards were not taken over: {loads(size.shards)}"
    )
    taken = acquired_at(old)
    early = {name: f"taken {taken[name]}, expired {expiry[name]}" for name in old if taken[name] < expiry[name]}
    assert not early, (
        f"{len(early)} shards taken before the frozen holder's lease expired, e.g. {list(early.items())[:3]}"
    )
    print(
        f"freeze takeover on {db_vendor}: {min(taken.values()) - frozen_at} to {max(taken.values()) - frozen_at} "
        f"after the stop (TTL {TTL}s)"
    )
    assert wait_until(lambda: balanced(size.shards, others), timeout=REBALANCE_SECONDS, interval=0.1), (
        f"not balanced over the two others: {loads(size.shards)}"
    )

    # When it resumes
    frozen.send(signal.SIGCONT)

    # Then within 15 s it holds shards again and the balance is within 20 %
    assert wait_until(lambda: balanced(size.shards, beats), timeout=REBALANCE_SECONDS, interval=0.1), (
        f"the resumed replica did not rejoin within {REBALANCE_SECONDS}s: {loads(size.shards)}; "
        f"its log tail:\n{frozen.log()[-3000:]}"
    )
    rejoined = all_fire_then_stop(beats, schedules, after="the rejoin")

    # ... nothing was committed under its old tokens after the takeover:
    # per shard, every old-token slot precedes every newer-token slot
    for name, token in old.items():
        under_old = Execution.objects.filter(lease_name=name, lease_token=token).aggregate(last=Max("scheduled_for"))[
            "last"
        ]
        newer = Execution.objects.filter(lease_name=name, lease_token__gt=token).aggregate(first=Min("scheduled_for"))[
            "first"
        ]
        assert newer is not None, f"{name}: nothing committed after the takeover"
        assert under_old is None or under_old < newer, (
            f"{name}: slot {under_old} committed under the frozen token {token} after {newer} under a newer one"
        )
    # ... and no slot has two rows, none was skipped
    assert_no_duplicate_and_no_gap(schedules, since=rejoined)
    assert_fenced_rows()
    assert_sent(redis_client)

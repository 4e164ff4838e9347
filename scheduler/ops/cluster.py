"""Who leads and who is alive, as the lease rows and the heartbeats say.

``Instance.is_leader`` is what a beat last wrote about itself: a replica
killed with SIGKILL never clears it, so after a crash several rows claim to
lead. The leader is whoever holds the lease now; the flag is never read.
With shards (a stored shard count above 1) each shard's lease has its own
leader, and ``shard_view`` reads them all, and the count, at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from django.db import connection

from scheduler import dbclock, shards
from scheduler.conf import settings
from scheduler.models import Instance, Schedule
from scheduler.models.schedule import ScheduleQuerySet
from scheduler.owners.leases import LeaseState


@dataclass(frozen=True)
class Member:
    """One registered instance as of a database-clock moment."""

    instance: Instance
    #: It holds an unexpired lease.
    is_leader: bool
    #: Seconds since its last heartbeat.
    age: float
    #: ``stale_after(role)``, in seconds.
    stale_after: float

    @property
    def is_stale(self) -> bool:
        """Silent for longer than ``stale_after``: presumably dead."""
        return self.age > self.stale_after


def stale_after(role: str) -> float:
    """Return the heartbeat age (seconds) past which an instance of ``role`` is presumed dead.

    A beat writes its heartbeat every lease renew interval, so one silent for
    a whole lease TTL could not have kept the lease. A worker writes it every
    claim renew interval (as long as the lease TTL by default, so the TTL
    would flag live workers); silent for ``CLAIM_SECONDS``, its claims are
    given up as lost.
    """
    if role == Instance.Role.BEAT:
        return settings.LEASE_TTL_SECONDS
    return settings.CLAIM_SECONDS


def members(*, leaders: Collection[str], now: datetime) -> list[Member]:
    """Return every registered instance by role, leaders first; ``leaders`` are the lease holders."""
    rows = []
    for instance in Instance.objects.all():
        age = max((now - instance.last_seen).total_seconds(), 0.0)
        rows.append(Member(instance, instance.instance_id in leaders, age, stale_after(instance.role)))
    return sorted(rows, key=lambda m: (m.instance.role, not m.is_leader, m.instance.instance_id))


def fresh_beats(members: list[Member]) -> list[str]:
    """Return the instance ids of the beat replicas among ``members`` whose heartbeat is not stale."""
    return [m.instance.instance_id for m in members if m.instance.role == Instance.Role.BEAT and not m.is_stale]


@dataclass(frozen=True)
class ShardView:
    """Every lease row and the shard count as of one database-clock moment."""

    db_now: datetime
    #: ``leases[k]`` is shard ``k``'s lease; a row never created reads free (token 0). Empty for a count of 1.
    leases: list[LeaseState]
    #: Lease rows that fence no shard of this count: the unsharded lease, or
    #: shards past N left by a larger count (a replica still on the old count holds them).
    others: list[LeaseState]
    #: The shard count the view is for (by default the stored one, read in the same query).
    count: int

    def state(self, name: str) -> LeaseState:
        """The lease row ``name`` as of ``db_now`` (free, token 0, when it was never created)."""
        found = next((state for state in (*self.leases, *self.others) if state.name == name), None)
        return found or LeaseState(name, "", 0, None, None, None, self.db_now)

    @property
    def not_held(self) -> list[LeaseState]:
        return [state for state in self.leases if not state.is_held]

    def unowned(self, *, within: float) -> list[LeaseState]:
        """Return the shards whose lease no holder renewed within ``within`` seconds (database clock)."""
        return [state for state in self.leases if not state.is_held or _renewed_age(state) > within]

    def by_replica(self, *, live: Collection[str] = ()) -> dict[str, list[int]]:
        """Return {instance id: the shards it holds}, holders and ``live`` replicas (maybe none held), by id."""
        held: dict[str, list[int]] = {instance_id: [] for instance_id in live}
        for shard, state in enumerate(self.leases):
            if state.is_held:
                held.setdefault(state.holder, []).append(shard)
        return dict(sorted(held.items()))

    @property
    def holders(self) -> set[str]:
        """Every instance holding a lease now, a shard's or another (both dispatch)."""
        return {state.holder for state in (*self.leases, *self.others) if state.is_held}


def shard_view(count: int | None = None) -> ShardView:
    """Return the shard leases of ``count`` shards (default: the stored count) and the other lease rows.

    One query: every lease row (one per shard, plus a few) with the
    database clock and the stored shard count, which also answers when the
    table is empty.
    """
    now_sql = dbclock.now_sql()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT clock.db_now, clock.stored, name, holder, token, acquired_at, renewed_at, expires_at "
            f"FROM (SELECT {now_sql} AS db_now, (SELECT shards FROM {shards.LAYOUT_TABLE} WHERE id = 1) AS stored) AS clock "
            f"LEFT JOIN scheduler_lease ON 1 = 1 ORDER BY name",
            [],
        )
        rows = cursor.fetchall()
    db_now = dbclock.as_datetime(rows[0][0])
    assert db_now is not None
    count = count or shards.resolve(rows[0][1], shards.configured())
    states = {
        row[2]: LeaseState.from_row(row[2:], db_now)
        for row in rows
        if row[2] is not None  # the clock's own row when no lease exists yet
    }
    names = shards.lease_names(count) if count > 1 else []
    return ShardView(
        db_now=db_now,
        leases=[
            states.pop(name) if name in states else LeaseState(name, "", 0, None, None, None, db_now) for name in names
        ],
        others=list(states.values()),
        count=count,
    )


def shard_ranges(numbers: list[int]) -> str:
    """Return ``0-3, 7, 9-10`` for [0, 1, 2, 3, 7, 9, 10] (sorted): a replica's shards on one short line."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


def _renewed_age(state: LeaseState) -> float:
    if state.renewed_at is None:
        return float("inf")
    return (state.db_now - state.renewed_at).total_seconds()


def stranded(count: int | None = None) -> ScheduleQuerySet:
    """Return the active schedules no replica dispatches: in a shard >= ``count`` (left by a larger count).

    Empty unsharded: one leader dispatches every shard. Through the partial
    index on ``(shard, next_run_at)``, so ``.exists()`` is one index probe.
    """
    count = count or shards.count()
    if count == 1:
        return Schedule.objects.none()
    return Schedule.objects.active().filter(next_run_at__isnull=False, shard__gte=count)

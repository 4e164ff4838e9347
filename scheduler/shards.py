"""Shards of the schedule table, their lease names, the count every replica follows, and which replica should own each.

Every schedule belongs to the shard stored in ``Schedule.shard`` (``id % N``
when it was saved or last moved), and with ``N > 1`` shard ``k`` is fenced by
the lease ``<LEASE_NAME>:<k>``; with ``N = 1`` the one lease ``LEASE_NAME``
fences every schedule. ``N`` is stored once, in the ``ShardLayout`` row,
and every process reads it from there (``count``), so replicas started with
different ``SCHEDULER_SHARDS`` never disagree about it: the setting only
seeds the row when none is stored yet.

Which live replica should hold a shard is decided by rendezvous
(highest-random-weight) hashing with a load bound: every replica computes
the same answer from the same list of live instances and the same count, a
shard's owner changes only when the list or the count does, and no replica
gets more than its fair share rounded up, so the shards stay within one of
even.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from django.db import connection

from scheduler import dbclock
from scheduler.conf import settings

#: The table of ``scheduler.models.ShardLayout`` (read here with SQL: the models import this module).
LAYOUT_TABLE = "scheduler_shardlayout"


def count() -> int:
    """How many shards the schedules are split into: the stored count, else ``SCHEDULER_SHARDS`` (1 = unsharded)."""
    return resolve(stored(), configured())


def configured() -> int:
    """This process's ``SCHEDULER_SHARDS``: what it stores as the count when none is stored yet."""
    return int(settings.SHARDS)


def resolve(stored: int | None, configured: int) -> int:
    """The count a process follows: the stored one whenever there is one, its own setting only before."""
    return configured if stored is None else stored


def stored() -> int | None:
    """The stored shard count (one primary-key read), or ``None`` when none is stored yet."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT shards FROM {LAYOUT_TABLE} WHERE id = 1", [])
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def seed(count: int, *, by: str) -> None:
    """Store ``count`` as the shard count unless one is stored already (that one wins)."""
    now = dbclock.now_sql()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {LAYOUT_TABLE} (id, shards, previous, changed_at, changed_by) "
            f"VALUES (1, %s, NULL, {now}, %s) ON CONFLICT (id) DO NOTHING",
            [count, by],
        )


def is_sharded() -> bool:
    return count() > 1


def shard_of(pk: int, shards: int | None = None) -> int:
    """The shard a schedule of primary key ``pk`` belongs to: stable while N stays."""
    return pk % (shards or count())


def lease_name(shard: int) -> str:
    return f"{settings.LEASE_NAME}:{shard}"


def lease_names(shards: int | None = None) -> list[str]:
    """The lease names of every shard, in shard order."""
    return [lease_name(shard) for shard in range(shards or count())]


def shard_of_lease(name: str) -> int | None:
    """The shard a lease name fences, or ``None`` for any other lease (the unsharded ``beat`` one included)."""
    prefix, _, number = name.rpartition(":")
    if prefix != settings.LEASE_NAME or not number.isdigit():
        return None
    return int(number)


def _weight(instance_id: str, shard: int) -> int:
    digest = hashlib.blake2b(f"{instance_id}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_owners(instances: Iterable[str], shards: int) -> dict[int, str]:
    """Return {shard: instance id} for ``shards`` shards over the live ``instances``.

    Rendezvous hashing, bounded: the (shard, instance) pairs are taken in
    order of their hash weight, and a pair is kept when its shard has no
    owner yet and its instance still has room: every instance takes
    ``shards // instances`` shards, and the first ones to want one more take
    the remainder. So each shard goes to the instance that weighs it highest
    unless that one is full; a join or a leave mostly moves the shards whose
    pairs it touches, and no two instances' loads differ by more than one.
    """
    members = sorted(set(instances))
    if not members:
        return {}
    base, extra = divmod(shards, len(members))
    pairs = sorted(
        ((_weight(member, shard), member, shard) for member in members for shard in range(shards)), reverse=True
    )
    owners: dict[int, str] = {}
    load = dict.fromkeys(members, 0)
    for _, member, shard in pairs:
        if shard in owners or load[member] > base or (load[member] == base and extra == 0):
            continue
        if load[member] == base:
            extra -= 1  # this instance takes one of the remainder's shards
        owners[shard] = member
        load[member] += 1
    return owners


def wanted(instance_id: str, live: Iterable[str], shards: int) -> list[int]:
    """The shards ``instance_id`` should hold among the ``live`` replicas (itself included) when there are ``shards``.

    Every live replica asks this with the same ``live`` set and the same
    stored count, so the answers partition the shards: each is wanted by
    exactly one of them.
    """
    owners = preferred_owners({*live, instance_id}, shards)
    return sorted(shard for shard, owner in owners.items() if owner == instance_id)

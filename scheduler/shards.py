"""Shards of the schedule table, their lease names, and which beat replica should own each.

With ``SCHEDULER_SHARDS = N > 1`` every schedule belongs to shard
``id % N`` (stored in ``Schedule.shard``), and shard ``k`` is fenced by the
lease ``<LEASE_NAME>:<k>``. Which live replica should hold a shard is
decided by rendezvous (highest-random-weight) hashing with a load bound: every
replica computes the same answer from the same list of live instances, a
shard's owner changes only when the list does, and no replica gets more than
its fair share rounded up, so the shards stay within one of even.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

from scheduler.conf import settings


def count() -> int:
    """How many shards the schedules are split into (``SCHEDULER_SHARDS``, 1 = unsharded)."""
    return int(settings.SHARDS)


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

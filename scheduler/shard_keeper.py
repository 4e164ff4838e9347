"""One beat replica's shards: the count it follows, which it holds, and each tick's step towards the ones it should hold.

Every tick a replica reads the stored shard count (``follow_count``), the
same for every replica whatever its ``SCHEDULER_SHARDS``. When it is more
than 1, every step:

1. renews every held shard in one statement, when a renewal is due; a
   shard not renewed is dropped at once (and a statement that fails drops
   them all: the caller steps down), so a replica never dispatches for a
   shard it is unsure of;
2. reads the live beat replicas: a heartbeat within the lease TTL (database
   clock) and, on PostgreSQL, the replica's instance lock held;
3. computes every shard's preferred owner for the stored count
   (``shards.preferred_owners``); after a change of the count, the shards of
   the old count that it no longer wants (those past the new count included)
   are released in 4 and the new ones taken in 5;
4. releases, in one statement, the shards it holds that another live
   replica should own (a NOTIFY wakes that replica on PostgreSQL);
5. takes, in one statement, the shards it should own that are free,
   expired, or held by a replica whose process is gone.

The fence itself is in the dispatch transaction (``leases.assert_held_many``):
the keeper only decides what to ask for.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.db import connection

from scheduler import leases, shards
from scheduler.conf import settings
from scheduler.models import Instance, Lease

logger = logging.getLogger(__name__)


def live_beats() -> set[str]:
    """Beat replicas alive now: heartbeat within the lease TTL and, on PostgreSQL, instance lock held."""
    since = leases.db_now() - timedelta(seconds=settings.LEASE_TTL_SECONDS)
    recent = set(
        Instance.objects.filter(role=Instance.Role.BEAT, last_seen__gt=since).values_list("instance_id", flat=True)
    )
    if connection.vendor == "postgresql":
        return leases.locked_instances(recent)
    return recent


def follow_count(instance_id: str) -> int:
    """Return the stored shard count, storing this replica's ``SCHEDULER_SHARDS`` first when none is stored yet.

    Replicas started together with different settings all end up following
    the first one stored (the insert ignores a row that exists).
    """
    stored = shards.stored()
    if stored is not None:
        return stored
    shards.seed(shards.configured(), by=instance_id)
    stored = shards.stored()
    assert stored is not None
    return stored


def _by_shard(handles: list[leases.LeaseHandle]) -> dict[int, leases.LeaseHandle]:
    """{shard: handle} for handles of shard leases (the keeper only ever asks for those)."""
    by_shard = {}
    for handle in handles:
        shard = shards.shard_of_lease(handle.name)
        assert shard is not None, handle.name
        by_shard[shard] = handle
    return by_shard


class ShardKeeper:
    """The shard leases one replica holds, kept in step with the live replicas."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        #: {shard: lease handle} held now.
        self.held: dict[int, leases.LeaseHandle] = {}
        #: The live replicas the last step saw, this one included.
        self.live: set[str] = {instance_id}
        self._last_renew = 0.0  # monotonic

    def watched(self) -> str | None:
        """The live replica after this one in id order, whose end this one waits for (``None``: alone)."""
        ring = sorted(self.live | {self.instance_id})
        following = ring[(ring.index(self.instance_id) + 1) % len(ring)]
        return None if following == self.instance_id else following

    def seconds_until_renew(self) -> float:
        if not self.held:
            return settings.LEASE_RENEW_SECONDS
        return settings.LEASE_RENEW_SECONDS - (time.monotonic() - self._last_renew)

    def step(self, count: int) -> dict[int, leases.LeaseHandle]:
        """Renew, release and take shards as the live replicas and the stored ``count`` say; return the shards held now."""
        ttl = settings.LEASE_TTL_SECONDS
        if self.held and self.seconds_until_renew() <= 0:
            self._renew(ttl)
        live = self.live = live_beats() | {self.instance_id}
        wanted = shards.wanted(self.instance_id, live, count)
        self._release(sorted(set(self.held) - set(wanted)))
        missing = [shard for shard in wanted if shard not in self.held]
        if missing:
            self._take(missing, live=live, ttl=ttl)
        return self.held

    def forget(self, names: tuple[str, ...] | None = None) -> list[int]:
        """Stop dispatching for the shards of ``names`` (all when ``None``); return those dropped.

        For shards found lost, or when it cannot be known (a renewal that
        failed): their rows may still name this replica, and it takes them
        again, under a new token, once it is sure.
        """
        dropped = [shard for shard, lease in self.held.items() if names is None or lease.name in names]
        for shard in dropped:
            del self.held[shard]
        return dropped

    def release_all(self) -> list[str]:
        """Give every held shard up (shutdown); return the lease names released."""
        released = leases.release_many(list(self.held.values()))
        self.held.clear()
        return released

    # --- steps -------------------------------------------------------------------

    def _renew(self, ttl: float) -> None:
        renewed = leases.renew_many(list(self.held.values()), ttl=ttl)
        lost = tuple(sorted({lease.name for lease in self.held.values()} - {lease.name for lease in renewed}))
        self.held = _by_shard(renewed)
        self._last_renew = time.monotonic()
        if lost:
            leases.record_renew_failure(*lost)
            logger.warning(
                "shards lost by %s: %s",
                self.instance_id,
                ", ".join(lost),
                extra={"action": "shards_lost", "instance_id": self.instance_id, "leases": list(lost)},
            )

    def _release(self, unwanted: list[int]) -> None:
        if not unwanted:
            return
        released = leases.release_many([self.held.pop(shard) for shard in unwanted])
        if released:
            logger.info(
                "shards released by %s to their preferred owners: %s",
                self.instance_id,
                ", ".join(released),
                extra={"action": "shards_released", "instance_id": self.instance_id, "leases": released},
            )

    def _take(self, wanted: list[int], *, live: set[str], ttl: float) -> None:
        names = [shards.lease_name(shard) for shard in wanted]
        gone: list[tuple[str, int]] = []
        if connection.vendor == "postgresql":
            # A holder that is not live here but whose lease has not expired:
            # if its instance lock is free its process is gone, so its shards
            # are taken now instead of a TTL later (as ``acquire``'s ``gone``).
            held_by_others = list(
                Lease.objects.filter(name__in=names)
                .exclude(holder__in=["", self.instance_id])
                .values_list("holder", "token")
            )
            alive = leases.locked_instances({holder for holder, _ in held_by_others})
            gone = [(holder, token) for holder, token in held_by_others if holder not in live and holder not in alive]
        taken = leases.acquire_many(names, self.instance_id, ttl=ttl, gone=gone)
        if not taken:
            return
        if not self.held:
            self._last_renew = time.monotonic()
        self.held.update(_by_shard(taken))
        logger.info(
            "shards taken by %s: %s",
            self.instance_id,
            ", ".join(f"{lease.name} (token {lease.token})" for lease in taken),
            extra={
                "action": "shards_acquired",
                "instance_id": self.instance_id,
                "leases": [lease.name for lease in taken],
            },
        )

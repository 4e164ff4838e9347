"""One beat replica's shards: the count it follows, which it holds, and each tick's step towards the ones it should hold.

Implements ``leadership.Leadership`` for a stored shard count above 1. Every
tick a replica reads the stored shard count (``follow_count``), the same for
every replica whatever its ``SCHEDULER_SHARDS``. While it is more than 1,
the keeper guarantees:

- a shard is dispatched for only while this replica is sure it holds it: a
  shard whose renewal is refused is dropped at once, and all of them when
  the renewal cannot be made (the database does not answer);
- every live replica (a heartbeat within the lease TTL, database clock, and
  on PostgreSQL its instance lock held) computes the same preferred owner
  for every shard (``shards.preferred_owners``), releases what another one
  should own and takes what it should own that is free, expired or held by
  a replica whose process is gone; after a change of the count the shards
  it no longer wants (those past the new count included) are released;
- on PostgreSQL a release, a join and a death wake every replica at once,
  so shards move within a tick instead of a TTL.

The fence itself is in the dispatch transaction (``leases.assert_held_many``):
the keeper only decides what to ask for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from datetime import timedelta

from django.db import DatabaseError, connection

from scheduler import dbclock, shards
from scheduler.beat import liveness
from scheduler.conf import settings
from scheduler.models import Instance, Lease
from scheduler.owners import leases

logger = logging.getLogger(__name__)


def live_beats() -> set[str]:
    """Beat replicas alive now: heartbeat within the lease TTL and, on PostgreSQL, instance lock held."""
    since = dbclock.now() - timedelta(seconds=settings.LEASE_TTL_SECONDS)
    recent = set(
        Instance.objects.filter(role=Instance.Role.BEAT, last_seen__gt=since).values_list("instance_id", flat=True)
    )
    if connection.vendor == "postgresql":
        return liveness.locked_instances(recent)
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
    """The shard leases one replica holds, kept in step with the live replicas and the stored ``count``."""

    def __init__(self, instance_id: str, count: int, *, lock: liveness.InstanceLock | None) -> None:
        self.instance_id = instance_id
        #: The stored shard count it follows (``leadership.following`` sets it on every change).
        self.count = count
        #: {shard: lease handle} held now.
        self.held: dict[int, leases.LeaseHandle] = {}
        #: The live replicas the last step saw, this one included.
        self.live: set[str] = {instance_id}
        #: PostgreSQL: this replica's instance lock, and its wait for the next replica's (``None`` on SQLite).
        self._lock = lock
        self._announced = False
        self._last_renew = 0.0  # monotonic

    def hold(self) -> dict[int, leases.LeaseHandle]:
        if self._lock is not None and not self._lock.try_acquire():
            self.forget()  # without our instance lock the others take our shards as a gone replica's
            return self.held
        if not self._announced and self._lock is not None:
            self._lock.notify("joined")  # the others release the shards this replica should own now
        self._announced = True
        return self.step()

    def watched(self) -> str | None:
        """The live replica after this one in id order, whose end this one waits for (``None``: alone)."""
        ring = sorted(self.live | {self.instance_id})
        following = ring[(ring.index(self.instance_id) + 1) % len(ring)]
        return None if following == self.instance_id else following

    def seconds_until_renew(self) -> float:
        if not self.held:
            return settings.LEASE_RENEW_SECONDS
        return settings.LEASE_RENEW_SECONDS - (time.monotonic() - self._last_renew)

    def wait(self, seconds: float) -> float:
        """On PostgreSQL, wait for a change among the replicas: any notification, or the watched replica gone.

        A notification is a shard released, a replica joined or found gone,
        or the count changed. When the watched replica is gone (its instance
        lock came free) the others are told, so every replica takes its new
        shards on its next tick instead of a TTL later.
        """
        if self._lock is None or seconds <= 0:
            return seconds
        watched = self.watched()
        outcome = self._lock.wait_for(watched, None, timeout=seconds)
        if outcome is None:
            return seconds
        if outcome is liveness.Wait.GONE:
            self._lock.notify(f"gone:{watched}")
        return 0.0

    def step(self) -> dict[int, leases.LeaseHandle]:
        """Renew, release and take shards as the live replicas and the stored ``count`` say; return the shards held now."""
        ttl = settings.LEASE_TTL_SECONDS
        if self.held and self.seconds_until_renew() <= 0:
            self._renew(ttl)
        live = self.live = live_beats() | {self.instance_id}
        wanted = shards.wanted(self.instance_id, live, self.count)
        self._release(sorted(set(self.held) - set(wanted)))
        missing = [shard for shard in wanted if shard not in self.held]
        if missing:
            self._take(missing, live=live, ttl=ttl)
        return self.held

    def lost(self, names: Collection[str]) -> None:
        held = [lease for lease in self.held.values() if lease.name in names]
        self.forget(names)
        leases.release_many(held)  # as ``OneLease.lost``: a row that still names this replica is freed now

    def pause(self) -> None:
        if dropped := self.forget():
            # Uncertain, so paused: taken again, under new tokens, once the database answers.
            logger.warning("shards %s paused until the database answers", dropped, extra={"action": "shards_paused"})

    def release(self, reason: str) -> None:
        try:
            released = leases.release_many(list(self.held.values()))
        except DatabaseError:
            logger.exception("could not release the shards %s; they expire by themselves", reason)
            self.forget()
            return
        self.held.clear()
        if released:
            logger.info(
                "shards released by %s %s: %s",
                self.instance_id,
                reason,
                ", ".join(released),
                extra={"action": "shards_released", "instance_id": self.instance_id, "leases": released},
            )

    def forget(self, names: Collection[str] | None = None) -> list[int]:
        """Stop dispatching for the shards of ``names`` (all when ``None``); return those dropped.

        For shards found lost, or when it cannot be known (a renewal that
        failed): their rows may still name this replica, and it takes them
        again, under a new token, once it is sure.
        """
        dropped = [shard for shard, lease in self.held.items() if names is None or lease.name in names]
        for shard in dropped:
            del self.held[shard]
        return dropped

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
            alive = liveness.locked_instances({holder for holder, _ in held_by_others})
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

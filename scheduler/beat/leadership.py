"""What a beat replica leads: the protocol its tick drives, and the one lease that fences every schedule.

A replica leads by the leases it holds, as a map ``{shard: lease}``: with a
stored shard count of 1 that is the one lease ``LEASE_NAME`` as ``{0: lease}``
(``OneLease``, here), with more the shard leases it should own among the
live replicas (``shard_keeper.ShardKeeper``). The beat asks the same three
things of either every tick: hold (renew what is held, take what is ours),
what is held, and wait for a change. Holding is only ever a claim to ask
for: what fences a commit is the lease row checked in the commit's own
transaction (``leases.assert_held_many``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Protocol

from django.db import DatabaseError

from scheduler import logs, signals
from scheduler.beat import liveness
from scheduler.beat.shard_keeper import ShardKeeper
from scheduler.conf import settings
from scheduler.exceptions import LeaseLost
from scheduler.owners import leases

logger = logging.getLogger(__name__)


class Leadership(Protocol):
    """The leases one beat replica holds, and the steps its tick takes with them."""

    #: {shard: lease} held now; the one lease is shard 0. Never dispatch for a lease not in here.
    held: dict[int, leases.LeaseHandle]

    def hold(self) -> dict[int, leases.LeaseHandle]:
        """Renew what is held once a renewal is due, take what this replica should hold; return what it holds now.

        A lease whose renewal is refused is dropped at once, so ``held``
        never names a lease this replica is unsure of.
        """

    def seconds_until_renew(self) -> float:
        """Seconds until a renewal is due: the beat ticks again by then, so no lease lapses in its sleep."""

    def wait(self, seconds: float) -> float:
        """Spend up to ``seconds`` waiting for who holds what to change (leading: for a sooner slot); return what is left.

        Returns at once (0) when a change means the next tick should come
        now; returns ``seconds`` unspent where there is nothing to wait on.
        """

    def lost(self, names: Collection[str]) -> None:
        """The fence found the leases ``names`` lost: stop dispatching for them, and give up their rows if still ours."""

    def pause(self) -> None:
        """The database does not answer: stop dispatching for everything held, without asking it.

        What was held is taken again, under new tokens, once it answers.
        """

    def release(self, reason: str) -> None:
        """Give everything held up, so another replica takes it at once (``reason`` is logged)."""


def following(
    current: Leadership, count: int, *, instance_id: str, lock: liveness.InstanceLock | None, sender: type
) -> Leadership:
    """Return what to hold under the stored shard ``count``: ``current`` when it is of the right kind, else the other kind.

    Between counts above 1 the keeper keeps the shards it still should own.
    Between 1 and more, ``current`` is given up first, so what this replica
    held under the old count is free at once for whoever takes it under the
    new one (and commits nothing meanwhile: the fence checks the count too).
    ``lock`` and ``sender`` are as for ``OneLease``.
    """
    if isinstance(current, ShardKeeper) and count > 1:
        current.count = count
        return current
    if isinstance(current, OneLease) and count == 1:
        return current
    if count == 1:
        current.release("for the one lease (shard count 1)")
        return OneLease(instance_id, lock=lock, sender=sender)
    current.release(f"for shards (the shard count is now {count})")
    return ShardKeeper(instance_id, count, lock=lock)


class OneLease:
    """The one lease ``LEASE_NAME``: at most one replica holds it, and it dispatches every schedule.

    A follower never exits: it keeps seeking the lease (unlike RedBeat,
    sibson/redbeat#230). On PostgreSQL it spends its sleep waiting for the
    holder's process to go (``liveness.InstanceLock``), and takes the lease
    over the moment it does, instead of a TTL later.
    """

    def __init__(self, instance_id: str, *, lock: liveness.InstanceLock | None, sender: type) -> None:
        self.instance_id = instance_id
        self.name: str = settings.LEASE_NAME
        self.held: dict[int, leases.LeaseHandle] = {}
        #: PostgreSQL: this replica's instance lock, and its wait for the holder's (``None`` on SQLite).
        self._lock = lock
        #: The ``sender`` of the leadership signals: the beat scheduler's class.
        self._sender = sender
        #: (holder, token) of a leader whose instance lock came free: its process is gone.
        self._holder_gone: tuple[str, int] | None = None
        self._last_renew = 0.0  # monotonic

    def hold(self) -> dict[int, leases.LeaseHandle]:
        lease = self.held.get(0)
        if lease is not None and self.seconds_until_renew() <= 0:
            try:
                self.held[0] = leases.renew(lease, ttl=settings.LEASE_TTL_SECONDS)
                self._last_renew = time.monotonic()
                self._hold_lease_lock()
            except LeaseLost:
                leases.record_renew_failure(self.name)
                self._step_down("lost")
        if not self.held:
            self._seek()
        return self.held

    def seconds_until_renew(self) -> float:
        return settings.LEASE_RENEW_SECONDS - (time.monotonic() - self._last_renew)

    def wait(self, seconds: float) -> float:
        """On PostgreSQL, wait for what calls for a tick before ``seconds`` are up.

        The leader waits for a schedule that may now fire sooner
        (``liveness.SCHEDULES_CHANGED``), so one created or moved to fire before
        its next slot fires on time. A follower waits for the holder's
        process to go or for a release of the lease; the next tick then takes
        the lease: by ``gone`` when the holder's instance lock came free, as
        usual after a release. SQLite has neither, so its replicas just sleep.
        """
        if self._lock is None or seconds <= 0:
            return seconds
        if self.held:
            return seconds if self._lock.wait_for(None, liveness.SCHEDULES_CHANGED, timeout=seconds) is None else 0.0
        state = leases.current(self.name)
        if not state.is_held or state.holder == self.instance_id:
            return seconds
        started = time.monotonic()
        outcome = self._lock.wait_for(state.holder, self.name, timeout=seconds)
        if outcome is None:
            return seconds  # the wait could not run: sleep, and reconnect on the next tick
        if outcome is liveness.Wait.GONE and liveness.lease_lock_held(self.name):
            # The holder has no instance lock, but someone holds the lock of
            # leading: a leader of the version before the instance lock (a
            # rolling upgrade), alive. Its lease runs out by TTL, or it
            # releases it: wait for that, as that version's followers do.
            left = max(seconds - (time.monotonic() - started), 0.0)
            return left if self._lock.wait_for(None, self.name, timeout=left) is None else 0.0
        if outcome is liveness.Wait.GONE:
            self._holder_gone = (state.holder, state.token)
        return 0.0

    def lost(self, names: Collection[str]) -> None:
        lease = self.held.get(0)
        if lease is None or lease.name not in names:
            return
        # Released as well: a no-op when another replica took it over, but
        # when the shard count changed under the commit the row still
        # names this replica, and nobody should wait out its TTL.
        leases.release(lease)
        self._step_down("lost")

    def pause(self) -> None:
        self._step_down("database unavailable")

    def release(self, reason: str) -> None:
        lease = self.held.pop(0, None)
        if lease is None:
            return
        try:
            released = leases.release(lease)
        except DatabaseError:
            released = False
            logger.exception("could not release the lease %s; it expires by itself", reason)
        self._drop_lease_lock()
        logs.unbind("token")
        if released:
            logger.info(
                "leadership released by %s (token %s) %s",
                self.instance_id,
                lease.token,
                reason,
                extra={"action": "lease_released", "instance_id": self.instance_id, "token": lease.token},
            )
        signals.leadership_lost.send(
            sender=self._sender, instance_id=self.instance_id, token=lease.token, reason="released"
        )

    # --- helpers -------------------------------------------------------------------

    def _seek(self) -> None:
        gone, self._holder_gone = self._holder_gone, None
        if self._lock is not None and not self._lock.try_acquire():
            # Followers take the lease from a holder whose instance lock
            # is free: leading without ours would only be taken away.
            return
        # ``gone``: the holder's process is gone, so take over now instead
        # of waiting for the TTL (unless someone else took over meanwhile).
        lease = leases.acquire(self.name, self.instance_id, ttl=settings.LEASE_TTL_SECONDS, gone=gone)
        if lease is None:
            return
        self.held[0] = lease
        logs.bind(token=lease.token)
        self._last_renew = time.monotonic()
        self._hold_lease_lock()
        logger.info(
            "leadership acquired by %s (token %s%s)",
            self.instance_id,
            lease.token,
            ", previous holder's session is gone" if gone else "",
            extra={"action": "lease_acquired", "instance_id": self.instance_id, "token": lease.token},
        )
        signals.leadership_acquired.send(sender=self._sender, instance_id=self.instance_id, token=lease.token)

    def _step_down(self, reason: str) -> None:
        lease = self.held.pop(0, None)
        if lease is None:
            return
        self._drop_lease_lock()
        logs.unbind("token")
        logger.warning(
            "leadership lost by %s (token %s): %s",
            self.instance_id,
            lease.token,
            reason,
            extra={"action": "lease_lost", "instance_id": self.instance_id, "token": lease.token},
        )
        signals.leadership_lost.send(
            sender=self._sender, instance_id=self.instance_id, token=lease.token, reason=reason
        )

    def _hold_lease_lock(self) -> None:
        """PostgreSQL, while leading: hold the lock replicas of the old version lead by.

        Without it, a replica of the version before the instance lock, still
        running during a rolling upgrade, would find that lock free, take
        the lease by force every second, and be taken over in turn
        (``liveness._lease_lock_key``).
        """
        if self._lock is not None:
            self._lock.hold_lease_lock(self.name)

    def _drop_lease_lock(self) -> None:
        if self._lock is not None:
            self._lock.release_lease_lock(self.name)

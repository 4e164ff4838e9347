"""Who leads and who is alive, as the lease row and the heartbeats say.

``Instance.is_leader`` is what a beat last wrote about itself: a replica
killed with SIGKILL never clears it, so after a crash several rows claim to
lead. The leader is whoever holds the lease now; the flag is never read.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from scheduler.conf import settings
from scheduler.models import Instance


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

"""``manage.py leases``: who leads, under which token, until when, and every replica's heartbeat.

An instance leads only while it holds a lease (read from the lease row, not
from the flag a beat wrote about itself); one whose heartbeat is older than
``cluster.stale_after(role)`` is marked stale.
"""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from scheduler import cluster, leases
from scheduler.management.base import SchedulerCommand
from scheduler.models import Lease


class Command(SchedulerCommand):
    help = """Show each lease (holder, fencing token, seconds until expiry) and every instance's heartbeat.

Times are read on the database clock, the one the lease decisions use. An
instance leads only while it holds a lease; one whose heartbeat is older than
the lease TTL (a worker: the claim duration) is marked STALE.

examples:
  manage.py leases
  manage.py leases --json | jq '.leases[0].holder'"""

    def add_arguments(self, parser: CommandParser) -> None:
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        names = list(Lease.objects.order_by("name").values_list("name", flat=True))
        states = [leases.current(name) for name in names]
        db_now = states[0].db_now if states else leases.db_now()
        members = cluster.members(leaders={state.holder for state in states if state.is_held}, now=db_now)
        by_id = {member.instance.instance_id: member.instance for member in members}

        lease_rows = []
        for state in states:
            leader = by_id.get(state.holder) if state.is_held else None
            lease_rows.append(
                {
                    "name": state.name,
                    "held": state.is_held,
                    "holder": state.holder if state.is_held else None,
                    "token": state.token,
                    "acquired_at": state.acquired_at,
                    "renewed_at": state.renewed_at,
                    "expires_at": state.expires_at,
                    "seconds_left": round(state.seconds_left, 3),
                    "leader_heartbeat_age_seconds": _age(leader.last_seen, db_now) if leader else None,
                }
            )
        instance_rows = [
            {
                "instance_id": member.instance.instance_id,
                "role": member.instance.role,
                "is_leader": member.is_leader,
                "stale": member.is_stale,
                "hostname": member.instance.hostname,
                "pid": member.instance.pid,
                "version": member.instance.version,
                "started_at": member.instance.started_at,
                "last_seen": member.instance.last_seen,
                "last_seen_age_seconds": _age(member.instance.last_seen, db_now),
            }
            for member in members
        ]
        lines = [f"database clock: {db_now.isoformat()}"]
        if not lease_rows:
            lines.append("no lease has ever been taken (no beat has run)")
        for row in lease_rows:
            if row["held"]:
                heartbeat = row["leader_heartbeat_age_seconds"]
                lines.append(
                    f"lease {row['name']}: held by {row['holder']} (token {row['token']}), "
                    f"expires in {row['seconds_left']:.1f}s, since {row['acquired_at'].isoformat()}"
                    + (f", heartbeat {heartbeat:.1f}s ago" if heartbeat is not None else ", no heartbeat row")
                )
            else:
                lines.append(f"lease {row['name']}: NOT HELD (last token {row['token']}): no beat replica is leading")
        lines.append(f"instances: {len(instance_rows)}")
        for row in instance_rows:
            lines.append(
                f"  {row['role']:<7}{' leader' if row['is_leader'] else '       '}  {row['instance_id']}  "
                f"last seen {row['last_seen_age_seconds']:.1f}s ago"
                + (f", STALE (no heartbeat for over {cluster.stale_after(row['role']):g}s)" if row["stale"] else "")
            )
        self.emit({"db_now": db_now, "leases": lease_rows, "instances": instance_rows}, as_json=options["json"], text=lines)


def _age(moment: Any, now: Any) -> float:
    return round((now - moment).total_seconds(), 3)

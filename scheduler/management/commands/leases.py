"""``manage.py leases``: who leads (each shard's leader), under which token, until when, and every replica's heartbeat.

An instance leads only while it holds a lease (read from the lease row, not
from the flag a beat wrote about itself); one whose heartbeat is older than
``cluster.stale_after(role)`` is marked stale.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler import dbclock, shards
from scheduler.checks import check_shards
from scheduler.management.base import SchedulerCommand
from scheduler.models import Lease
from scheduler.ops import cluster
from scheduler.owners import leases


class Command(SchedulerCommand):
    help = """Show each lease (holder, fencing token, seconds until expiry) and every instance's heartbeat.

Times are read on the database clock, the one the lease decisions use. An
instance leads only while it holds a lease; one whose heartbeat is older than
the lease TTL (a worker: the claim duration) is marked STALE. With
a shard count above 1: one line per shard lease (NOT HELD: its schedules
are not dispatched), the shards each beat replica holds, and any other lease
row (the unsharded one, or shards left by a larger count).

examples:
  manage.py leases
  manage.py leases --json | jq '.leases[0].holder'
  manage.py leases --json | jq '.replicas'"""

    def add_arguments(self, parser: CommandParser) -> None:
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        count = shard_count()
        if count > 1:
            self._sharded(cluster.shard_view(count), as_json=options["json"])
            return
        names = list(Lease.objects.order_by("name").values_list("name", flat=True))
        states = [leases.current(name) for name in names]
        db_now = states[0].db_now if states else dbclock.now()
        members = cluster.members(leaders={state.holder for state in states if state.is_held}, now=db_now)
        lease_rows = _lease_rows(states, members, db_now=db_now)
        instance_rows = _instance_rows(members, db_now=db_now)
        lines = [f"database clock: {db_now.isoformat()}"]
        if not lease_rows:
            lines.append("no lease has ever been taken (no beat has run)")
        lines += [_lease_line(row, not_held="no beat replica is leading") for row in lease_rows]
        lines += _instance_lines(instance_rows)
        self.emit(
            {"db_now": db_now, "leases": lease_rows, "instances": instance_rows}, as_json=options["json"], text=lines
        )

    def _sharded(self, view: cluster.ShardView, *, as_json: bool) -> None:
        db_now = view.db_now
        members = cluster.members(leaders=view.holders, now=db_now)
        replicas: dict[str, dict[str, Any]] = {
            instance_id: {"count": len(owned), "shards": owned}
            for instance_id, owned in view.by_replica(live=cluster.fresh_beats(members)).items()
        }
        shard_rows = [
            {"shard": shard, **row} for shard, row in enumerate(_lease_rows(view.leases, members, db_now=db_now))
        ]
        other_rows = [{"shard": None, **row} for row in _lease_rows(view.others, members, db_now=db_now)]
        not_held = [state.name for state in view.not_held]
        instance_rows = _instance_rows(members, db_now=db_now)

        lines = [
            f"database clock: {db_now.isoformat()}",
            f"shards: {view.count} ({'SCHEDULER_SHARDS' if shards.stored() is None else 'stored'}), {view.count - len(not_held)} held"
            + (f", NOT HELD {len(not_held)}: {', '.join(not_held)}" if not_held else ", every shard held"),
            f"shards per replica ({len(replicas)} replica{'' if len(replicas) == 1 else 's'}):",
        ]
        lines += [
            f"  {instance_id}  {row['count']} shard{'' if row['count'] == 1 else 's'}"
            + (f" ({cluster.shard_ranges(row['shards'])})" if row["shards"] else "")
            for instance_id, row in replicas.items()
        ]
        lines += [_lease_line(row, not_held="its schedules are not dispatched") for row in shard_rows]
        if other_rows:
            lines.append(
                f"other leases (no shard of {view.count}; held: a beat has not followed the count yet, or runs an older version):"
            )
            lines += [_lease_line(row, not_held="unused") for row in other_rows]
        lines += _instance_lines(instance_rows)
        data = {
            "db_now": db_now,
            "shards": view.count,
            "not_held": not_held,
            "replicas": replicas,
            "leases": shard_rows + other_rows,
            "instances": instance_rows,
        }
        self.emit(data, as_json=as_json, text=lines)


def shard_count() -> int:
    """Return the shard count (stored, else ``SCHEDULER_SHARDS``); an invalid setting is refused in one line as check E006 refuses it."""
    errors = check_shards()
    if errors:
        raise CommandError(errors[0].msg)
    return shards.count()


def _lease_rows(
    states: list[leases.LeaseState], members: list[cluster.Member], *, db_now: datetime
) -> list[dict[str, Any]]:
    by_id = {member.instance.instance_id: member.instance for member in members}
    rows = []
    for state in states:
        leader = by_id.get(state.holder) if state.is_held else None
        rows.append(
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
    return rows


def _instance_rows(members: list[cluster.Member], *, db_now: datetime) -> list[dict[str, Any]]:
    return [
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


def _lease_line(row: dict[str, Any], *, not_held: str) -> str:
    if not row["held"]:
        return f"lease {row['name']}: NOT HELD (last token {row['token']}): {not_held}"
    heartbeat = row["leader_heartbeat_age_seconds"]
    return (
        f"lease {row['name']}: held by {row['holder']} (token {row['token']}), "
        f"expires in {row['seconds_left']:.1f}s, since {row['acquired_at'].isoformat()}"
        + (f", heartbeat {heartbeat:.1f}s ago" if heartbeat is not None else ", no heartbeat row")
    )


def _instance_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"instances: {len(rows)}"]
    for row in rows:
        lines.append(
            f"  {row['role']:<7}{' leader' if row['is_leader'] else '       '}  {row['instance_id']}  "
            f"last seen {row['last_seen_age_seconds']:.1f}s ago"
            + (f", STALE (no heartbeat for over {cluster.stale_after(row['role']):g}s)" if row["stale"] else "")
        )
    return lines


def _age(moment: Any, now: Any) -> float:
    return round((now - moment).total_seconds(), 3)

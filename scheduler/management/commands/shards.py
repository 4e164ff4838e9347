"""``manage.py shards``: the shard count, schedules per shard, the stranded ones, and who should own which shard.

The count is stored in the database (``ShardLayout``) and every beat replica
follows it; ``--set N`` changes it while the beats run (``resharding``). A
schedule is dispatched under the lease of its stored ``shard``, which is
``id % N`` when it was saved or last moved. A schedule whose shard is not
``id % N`` is misplaced; if its shard is past the count it is stranded: no
replica holds that shard's lease, so it is not dispatched until ``--assign``
moves it (``scheduler.owners.schedules.assign_shards``).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db.models import Count, F, Q

from scheduler import shards
from scheduler.beat import shard_keeper
from scheduler.checks import MAX_SHARDS, check_shards
from scheduler.management.base import SchedulerCommand
from scheduler.models import Schedule
from scheduler.ops import audit, cluster, operations, resharding


class Command(SchedulerCommand):
    help = """Show the shard count, the schedules in each shard, and the shards each live beat replica should own; change the count.

The count is stored in the database and every beat replica follows it,
whatever its SCHEDULER_SHARDS (which only stores the count when none is
stored yet). --set N changes it while the beats run: the replicas give up
the old shards and take the new ones on their next tick, and the schedules
move into shard id % N in the order that keeps each one owned (it waits up
to twice the lease TTL for the replicas to hold the new shards). 1 runs one
leader under the lease "beat"; N > 1 runs the leases "beat:0" ... "beat:N-1".

A schedule is dispatched by whichever beat replica holds its shard's lease.
"not in id % N" counts schedules left in another shard; those in a shard
past the count are STRANDED: not dispatched until --assign moves every
schedule into shard id % N. --assign and --set are safe while the beats run
(each dispatch re-checks a schedule's shard under its row lock, and the
count under a shared lock). Counting reads every schedule once; --assign
writes only those it moves.

examples:
  manage.py shards
  manage.py shards --set 8 --dry-run
  manage.py shards --set 8
  manage.py shards --assign
  manage.py shards --json | jq '.stranded'"""

    writes = True
    # An invalid SCHEDULER_SHARDS is refused in one line by handle(), not by Django's check report.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--set",
            type=int,
            metavar="N",
            dest="set_count",
            help=f"store N (1 to {MAX_SHARDS}) as the shard count every beat replica follows, then move every schedule into shard id %% N",
        )
        action.add_argument(
            "--assign",
            action="store_true",
            help="move every schedule whose shard is not id %% N into it, and say how many moved",
        )
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        errors = check_shards()
        if errors:
            raise CommandError(errors[0].msg)
        wanted = options["set_count"]
        if wanted is not None and not 1 <= wanted <= MAX_SHARDS:
            raise CommandError(f"--set takes a shard count from 1 to {MAX_SHARDS}, got {wanted}")
        if options["dry_run"] and not options["assign"] and wanted is None:
            raise CommandError("--dry-run goes with --assign or --set: the report alone changes nothing")
        if wanted is not None:
            self._set(wanted, dry_run=options["dry_run"], as_json=options["json"])
            return
        count = shards.count()
        if options["assign"]:
            self._assign(count, dry_run=options["dry_run"], as_json=options["json"])
        else:
            self._report(count, as_json=options["json"])

    def _set(self, count: int, *, dry_run: bool, as_json: bool) -> None:
        if dry_run:
            change = resharding.change_count(count, by="manage.py shards --set", dry_run=True)
        else:
            change = operations.change_shard_count(count, actor=audit.CLI, by="manage.py shards --set")
        plural = "s" if change.moved != 1 else ""
        text: str | list[str]
        if dry_run:
            text = f"would change the shard count from {change.previous} to {count} and move {change.moved} schedule{plural} into shard id % {count}"
        else:
            held = "the one lease" if count == 1 else "every shard"
            text = [
                f"shard count {change.previous} -> {count}"
                if change.previous != count
                else f"shard count stays {count}",
                {
                    True: f"{held} held by a live beat replica",
                    False: f"not {held} held by a live beat replica after waiting (one frozen or starting?): "
                    "the schedules moved anyway; `manage.py shards` shows who holds what",
                    None: "no beat replica live: the replicas follow the count when they start",
                }[change.settled],
                f"moved {change.moved} schedule{plural} into shard id % {count}",
            ]
        self.emit(
            {
                "previous": change.previous,
                "shards": count,
                "moved": change.moved,
                "settled": change.settled,
                "dry_run": dry_run,
            },
            as_json=as_json,
            text=text,
        )

    def _assign(self, count: int, *, dry_run: bool, as_json: bool) -> None:
        if dry_run:
            moved = Schedule.objects.exclude(shard=F("id") % count).count()
        else:
            moved = operations.assign_shards(actor=audit.CLI)
        verb = "would move" if dry_run else "moved"
        self.emit(
            {"shards": count, "moved": moved, "dry_run": dry_run},
            as_json=as_json,
            text=f"{verb} {moved} schedule{'s' if moved != 1 else ''} into shard id % {count}",
        )

    def _report(self, count: int, *, as_json: bool) -> None:
        rows = (
            Schedule.objects.order_by("shard")
            .values("shard")
            .annotate(schedules=Count("id"), misplaced=Count("id", filter=~Q(shard=F("id") % count)))
        )
        by_shard = [{**row, "stranded": count > 1 and row["shard"] >= count} for row in rows]
        total = sum(row["schedules"] for row in by_shard)
        misplaced = sum(row["misplaced"] for row in by_shard)
        stranded = sum(row["schedules"] for row in by_shard if row["stranded"])
        replicas = _replicas(count) if count > 1 else {}

        stored, configured = shards.stored(), shards.configured()
        if stored is None:
            source = "SCHEDULER_SHARDS; none stored yet: the first beat replica stores it"
        elif stored == configured:
            source = "stored"
        else:
            source = f"stored; SCHEDULER_SHARDS here is {configured}, which only seeds an empty table"
        lines = [f"shards: {count} ({source})" + ("; 1 runs one leader for every schedule" if count == 1 else "")]
        lines.append(
            f"schedules: {total}; not in shard id % {count}: {misplaced}"
            + (
                f"; STRANDED in shards >= {count}: {stranded} (not dispatched until manage.py shards --assign)"
                if stranded
                else ""
            )
        )
        if by_shard:
            lines.append(f"  {'shard':>5}  {'schedules':>9}  {'not in id % N':>13}")
            lines += [
                f"  {row['shard']:>5}  {row['schedules']:>9}  {row['misplaced']:>13}"
                + ("  STRANDED" if row["stranded"] else "")
                for row in by_shard
            ]
        if count > 1:
            lines.append(f"live beat replicas: {len(replicas)}")
            lines += [
                f"  {instance_id}  prefers {_listed(row['preferred'])} (holds {_listed(row['held'])})"
                for instance_id, row in replicas.items()
            ]
            if not replicas:
                lines.append("  none live (a heartbeat within the lease TTL; on PostgreSQL, its instance lock held)")
        data = {
            "shards": count,
            "stored": stored,
            "configured": configured,
            "schedules": total,
            "misplaced": misplaced,
            "stranded": stranded,
            "by_shard": by_shard,
            "replicas": replicas,
        }
        self.emit(data, as_json=as_json, text=lines)


def _replicas(count: int) -> dict[str, dict[str, list[int]]]:
    """{live beat replica: the shards it should own (rendezvous, as the beats compute it) and those it holds}."""
    live = shard_keeper.live_beats()
    preferred: dict[str, list[int]] = {instance_id: [] for instance_id in sorted(live)}
    for shard, owner in sorted(shards.preferred_owners(live, count).items()):
        preferred[owner].append(shard)
    held = cluster.shard_view(count).by_replica(live=live)
    return {instance_id: {"preferred": preferred[instance_id], "held": held[instance_id]} for instance_id in preferred}


def _listed(numbers: list[int]) -> str:
    return cluster.shard_ranges(numbers) or "none"

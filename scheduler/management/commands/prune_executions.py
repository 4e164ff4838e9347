"""``manage.py prune_executions``: delete old finished executions in batches."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler import dbclock
from scheduler.management.base import SchedulerCommand, non_negative_int, parse_duration
from scheduler.models import Execution
from scheduler.ops import audit, operations


class Command(SchedulerCommand):
    help = """Delete finished executions older than a duration, in batches.

Only final statuses are deleted (succeeded, failed, timed_out, cancelled,
skipped, missed); executions in flight or lost are never touched. Age is
counted from when an execution finished (or was recorded, if it never ran),
on the database clock.

examples:
  manage.py prune_executions --older-than 30d --dry-run
  manage.py prune_executions --older-than 30d --keep-last 100
  manage.py prune_executions --older-than 7d --status skipped --status missed"""

    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, metavar="DURATION", help="e.g. 30d, 12h, 90m, 45s, 2w")
        parser.add_argument(
            "--keep-last",
            type=non_negative_int,
            default=0,
            metavar="N",
            help="keep the newest N executions of each schedule whatever their age",
        )
        parser.add_argument(
            "--status",
            action="append",
            choices=sorted(Execution.FINAL_STATUSES),
            metavar="STATUS",
            help="only this final status (repeatable): " + ", ".join(sorted(Execution.FINAL_STATUSES)),
        )
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        age = parse_duration(options["older_than"], name="--older-than")
        if not age:
            raise CommandError("--older-than must be longer than 0")
        cutoff = dbclock.now() - age
        dry_run = options["dry_run"]
        # Audit events are not pruned here: the daily task keeps them as long as SCHEDULER_PRUNE_OLDER_THAN_DAYS.
        report = operations.prune_history(
            actor=audit.CLI,
            older_than=cutoff,
            keep_last=options["keep_last"],
            statuses=options["status"],
            dry_run=dry_run,
            progress=None if options["json"] else lambda n: self.stderr.write(f"deleted {n}..."),
        ).report
        verb = "would delete" if report.dry_run else "deleted"
        count = report.matched if report.dry_run else report.deleted
        self.emit(
            {"older_than": cutoff, "matched": report.matched, "deleted": report.deleted, "dry_run": report.dry_run},
            as_json=options["json"],
            text=f"{verb} {count} execution(s) finished before {cutoff.isoformat()}",
        )

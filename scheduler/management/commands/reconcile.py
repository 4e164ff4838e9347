"""``manage.py reconcile``: one reconcile pass, printing each change."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler.management.base import SchedulerCommand
from scheduler.ops import audit, operations
from scheduler.ops.reconcile import Change


class Command(SchedulerCommand):
    help = """Repair what crashes and lost messages leave behind; print each change.

One pass: running executions whose worker stopped renewing their lease are
marked lost, then retried (attempts left) or failed; pending executions older
than SCHEDULER_RECONCILE_PENDING_AFTER_SECONDS are sent; queued ones no
worker claimed within SCHEDULER_RECONCILE_QUEUED_AFTER_SECONDS are sent again
(a worker runs each execution once, so that is safe); schedules whose
next_run_at is missing or not a slot of their timing get it recomputed;
instances silent for SCHEDULER_RECONCILE_INSTANCE_STALE_SECONDS are removed.

Audit: slots each active schedule owes that have no execution are listed;
--repair records them under the schedule's misfire policy. A schedule owes
the slots since its owed_since (moved on resume, re-enable and timing edits),
within its catch-up window and SCHEDULER_PRUNE_OLDER_THAN_DAYS, and after the
newest slot any prune deleted (its pruned_through). A pass audits up to 1,000
schedules, round-robin by id within one process.

The beat leader runs the same pass (without --repair) every
SCHEDULER_RECONCILE_INTERVAL_SECONDS. Exits 1 when the broker refused a send.

examples:
  manage.py reconcile --dry-run
  manage.py reconcile
  manage.py reconcile --repair --dry-run
  manage.py reconcile --json | jq '.counts'"""

    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--repair",
            action="store_true",
            help="record the slots the audit finds missing, under each schedule's misfire policy",
        )
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        dry_run, repair = options["dry_run"], options["repair"]
        report = operations.reconcile_pass(actor=audit.CLI, dry_run=dry_run, repair=repair)
        lines = [_line(change) for change in report.changes]
        lines.append(("dry run, nothing changed: " if report.dry_run else "reconcile: ") + report.summary())
        self.emit(report.as_dict(), as_json=options["json"], text=lines)
        if report.publish_error:
            raise CommandError(report.publish_error)


def _line(change: Change) -> str:
    subject = f"execution {change.execution_id}" if change.execution_id is not None else ""
    if not subject and change.schedule_id is not None:
        subject = f"schedule {change.schedule_id}"
    return f"{change.kind:<16} {subject + ': ' if subject else ''}{change.detail}"

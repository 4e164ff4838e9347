"""``manage.py pause``: hold (or drain) the work of a queue, of tasks matching a pattern, of a tenant, or everything."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from scheduler.management.base import SchedulerCommand
from scheduler.models import PauseRule
from scheduler.ops import audit, operations
from scheduler.tenancy import EVERY_TENANT


def add_rule_arguments(parser: CommandParser) -> None:
    """The options that say which work: shared by ``pause`` and ``resume``."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--all", dest="everything", action="store_true", help="every tenant's work, every queue and task"
    )
    which.add_argument("--tenant", metavar="NAME", help="one tenant's work (with --queue or --task: only that of it)")
    parser.add_argument("--queue", default="", metavar="Q", help="work on this queue")
    parser.add_argument("--task", default="", metavar="PATTERN", help="tasks whose name matches (* and ? match)")


class Command(SchedulerCommand):
    help = """Hold the work of a queue, of tasks matching a pattern, of a tenant, or everything; --drain also cancels what waits.

While a pause rule holds work, the beat dispatches none of its schedules'
slots (when it is lifted, each schedule's catch-up window and misfire policy
decide which of the slots that fell in the pause run), and workers claim
none of its executions: submit() and plain Celery calls wait `queued` and
are sent again on resume. What already runs finishes. Without options,
lists the rules in force. Every pause is audited; `manage.py resume` lifts it.

examples:
  manage.py pause --queue reports --reason "vendor outage"
  manage.py pause --task "billing.*" --drain
  manage.py pause --tenant acme
  manage.py pause --all --reason "database migration"
  manage.py pause"""

    def add_arguments(self, parser: CommandParser) -> None:
        add_rule_arguments(parser)
        parser.add_argument("--drain", action="store_true", help="also cancel the waiting executions it matches")
        parser.add_argument("--reason", default="", metavar="TEXT", help="why (shown in the admin and the audit)")
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if not (options["everything"] or options["tenant"] is not None or options["queue"] or options["task"]):
            rules = list(PauseRule.objects.order_by("pk"))
            data = [{"id": rule.pk, "rule": rule.describe(), "reason": rule.reason} for rule in rules]
            lines = [f"{rule.pk:>5}  {rule.describe()}  {rule.reason}".rstrip() for rule in rules]
            self.emit(data, as_json=options["json"], text=lines or ["Nothing is paused."])
            return
        result = operations.pause_work(
            actor=audit.CLI,
            scope=EVERY_TENANT,
            queue=options["queue"],
            task=options["task"],
            tenant=options["tenant"],
            everything=options["everything"],
            mode=PauseRule.Mode.DRAIN if options["drain"] else PauseRule.Mode.HOLD,
            reason=options["reason"],
        )
        rule = result.rule
        text = f"Paused: {rule.describe()} (rule {rule.pk})."
        if rule.mode == PauseRule.Mode.DRAIN:
            text += f" {result.cancelled} waiting execution(s) cancelled."
        self.emit(
            {"id": rule.pk, "rule": rule.describe(), "cancelled": result.cancelled}, as_json=options["json"], text=text
        )

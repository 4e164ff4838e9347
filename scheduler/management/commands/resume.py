"""``manage.py resume``: lift the pause rules on a queue, tasks, a tenant or everything; send what they held."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler.celery_app import celery_app
from scheduler.management.base import SchedulerCommand
from scheduler.management.commands.pause import add_rule_arguments
from scheduler.models import PauseRule
from scheduler.ops import audit, operations


class Command(SchedulerCommand):
    help = """Lift the pause rules that match exactly (hold and drain alike), audited; send again what they held.

Executions another rule still holds keep waiting. Schedules fire again from
their next pass: their catch-up window and misfire policy decide which of
the slots that fell in the pause run.

examples:
  manage.py resume --queue reports
  manage.py resume --all
  manage.py resume --rule 7"""

    def add_arguments(self, parser: CommandParser) -> None:
        add_rule_arguments(parser)
        parser.add_argument("--rule", type=int, metavar="ID", help="the rule with this id (see `manage.py pause`)")
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        rules = _rules(options)
        if not rules:
            raise CommandError("No pause rule matches; `manage.py pause` lists the rules in force.")
        app = celery_app()
        sent = sum(operations.resume_work(rule, actor=audit.CLI, app=app) for rule in rules)
        data = {"resumed": [rule.describe() for rule in rules], "sent": sent}
        lines = [f"Resumed: {rule.describe()} (rule {rule.pk})." for rule in rules]
        self.emit(data, as_json=options["json"], text=[*lines, f"{sent} held execution(s) sent again."])


def _rules(options: dict[str, Any]) -> list[PauseRule]:
    if options["rule"] is not None:
        return list(PauseRule.objects.filter(pk=options["rule"]))
    if not (options["everything"] or options["tenant"] is not None or options["queue"] or options["task"]):
        raise CommandError("Say which pause to lift: --queue, --task, --tenant, --all or --rule ID.")
    tenant = options["tenant"]
    whose = {"every_tenant": True, "tenant": ""} if tenant is None else {"every_tenant": False, "tenant": tenant}
    return list(PauseRule.objects.filter(**whose, queue=options["queue"], task=options["task"]).order_by("pk"))

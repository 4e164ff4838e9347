"""``manage.py calendars``: list, show, set and delete the calendars schedules exclude or run only on."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler import clock
from scheduler.management.base import SchedulerCommand, parse_json
from scheduler.models import Calendar
from scheduler.ops import audit, operations
from scheduler.owners import calendars
from scheduler.tenancy import EVERY_TENANT


class Command(SchedulerCommand):
    help = """List, show, set (create or replace the rules of) and delete calendars.

A calendar is a set of days from rules (JSON): dates and ranges, yearly
dates, weekdays, a country's or a market's holidays, a cron's days, and the
days of other calendars joined or subtracted. A schedule excludes calendars
(--exclude-calendars on `schedules`, or the admin) or runs only on one.
`show` lists the next days it holds. Every change is audited.

examples:
  manage.py calendars set us-holidays --rules '[{"holidays": {"country": "US"}}]'
  manage.py calendars set weekend --rules '[{"weekdays": ["sat", "sun"]}]'
  manage.py calendars set business-days --rules '[{"cron": "* * * * *"}, {"except": "weekend"}, {"except": "us-holidays"}]'
  manage.py calendars show business-days --days 10
  manage.py calendars list
  manage.py calendars delete weekend"""

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = actions.add_parser("list", help="every calendar")
        show = actions.add_parser("show", help="a calendar's rules and the next days it holds")
        show.add_argument("name")
        show.add_argument("--days", type=int, default=10, metavar="N", help="how many of its next days (default 10)")
        put = actions.add_parser("set", help="create a calendar, or replace its rules")
        put.add_argument("name")
        put.add_argument("--rules", required=True, metavar="JSON", help="its rules, a JSON list")
        delete = actions.add_parser("delete", help="delete a calendar no schedule or calendar names")
        delete.add_argument("name")
        for sub in (listing, show, put, delete):
            sub.add_argument(
                "--tenant", default="", metavar="NAME", help="the tenant's calendar (default: every tenant's)"
            )
            self.add_common_arguments(sub)

    def handle(self, *args: Any, **options: Any) -> None:
        action, tenant, as_json = options["action"], options["tenant"], options["json"]
        if action == "list":
            rows = list(Calendar.objects.filter(tenant=tenant) if tenant else Calendar.objects.all())
            data = [{"name": row.name, "tenant": row.tenant, "rules": row.rules} for row in rows]
            lines = [f"{row.name}  {row.tenant or '(every tenant)'}  {row.rules}" for row in rows]
            self.emit(data, as_json=as_json, text=lines or ["No calendars."])
            return
        if action == "set":
            kept = Calendar.objects.filter(tenant=tenant, name=options["name"]).first()
            row = kept or Calendar(tenant=tenant, name=options["name"])
            row.rules = parse_json(options["rules"], name="--rules", kind=list)
            operations.save_calendar(row, actor=audit.CLI, scope=EVERY_TENANT)
            self.emit(
                {"name": row.name, "tenant": row.tenant, "rules": row.rules},
                as_json=as_json,
                text=f"Saved calendar {row.name}.",
            )
            return
        found = Calendar.objects.filter(tenant=tenant, name=options["name"]).first()
        if found is None:
            raise CommandError(f"No calendar {options['name']!r}" + (f" of tenant {tenant!r}" if tenant else ""))
        row = found
        if action == "delete":
            operations.delete_calendar(row, actor=audit.CLI, scope=EVERY_TENANT)
            self.emit({"deleted": row.name}, as_json=as_json, text=f"Deleted calendar {row.name}.")
            return
        if not 1 <= options["days"] <= 366:
            raise CommandError("--days must be from 1 to 366")
        held = calendars.resolve(row.tenant, row.name, max_age=0)
        day, days = clock.now().date(), []
        for _ in range(3660):
            if held.contains(day):
                days.append(day.isoformat())
                if len(days) >= options["days"]:
                    break
            day = day.fromordinal(day.toordinal() + 1)
        self.emit(
            {"name": row.name, "tenant": row.tenant, "rules": row.rules, "next_days": days},
            as_json=as_json,
            text=[f"{row.name}: {row.rules}", *(f"  {entry}" for entry in days)] or [],
        )

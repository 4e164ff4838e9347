"""``manage.py import_celery_beat``: create schedules from django-celery-beat's periodic tasks."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS

from scheduler.celery_app import celery_app
from scheduler.management.base import SchedulerCommand, text_value
from scheduler.ops import audit
from scheduler.ops.import_celery_beat import (
    EXISTS,
    IMPORTED,
    REFUSED,
    CeleryBeatImportRefused,
    ImportReport,
    TaskOutcome,
    import_periodic_tasks,
)


class Command(SchedulerCommand):
    help = """Create a schedule for each of django-celery-beat's periodic tasks that has an equivalent here.

Crontab (with its time zone), interval and clocked tasks carry over with their
task, arguments, queue, priority, message options (exchange, routing key,
headers, expire_seconds), enabled state, one-off, start, expiry and
description. Solar schedules and crontabs that restrict both day of month
and day of week are refused with the reason. A task whose name already
has a schedule is left alone, so running the import again creates nothing.
django-celery-beat's tables are only read, with SQL: its package need not be
installed.

examples:
  manage.py import_celery_beat --dry-run
  manage.py import_celery_beat
  manage.py import_celery_beat --database old --json"""

    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            metavar="ALIAS",
            help=f"the DATABASES alias holding django-celery-beat's tables (default {DEFAULT_DB_ALIAS!r})",
        )
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = import_periodic_tasks(
                using=options["database"], app=celery_app(), actor=audit.CLI, dry_run=options["dry_run"]
            )
        except CeleryBeatImportRefused as exc:
            raise CommandError(str(exc)) from None
        self.emit(asdict(report), as_json=options["json"], text=_lines(report))


def _lines(report: ImportReport) -> list[str]:
    lines = [_line(task, dry_run=report.dry_run) for task in report.tasks]
    imported = f"{report.counts[IMPORTED]} {'would be imported' if report.dry_run else 'imported'}"
    summary = (
        f"{imported}, {report.counts[EXISTS]} exist(s), {report.counts[REFUSED]} refused "
        f"(periodic tasks in database {report.database!r})."
    )
    lines.append(f"Dry run, nothing changed: {summary}" if report.dry_run else summary)
    return lines


def _line(task: TaskOutcome, *, dry_run: bool) -> str:
    if task.outcome == REFUSED:
        return f"{task.name}: refused: {task.reason}"
    if task.outcome == EXISTS:
        return f"{task.name}: exists (a schedule of that name is left alone)"
    line = f"{task.name}: {'would be imported' if dry_run else 'imported'} ({_timing_text(task.schedule or {})})"
    return "; ".join([line, *task.notes])


def _timing_text(fields: dict[str, Any]) -> str:
    if fields.get("cron"):
        text = f"cron {fields['cron']} in {fields['timezone']}"
    elif fields.get("interval"):
        text = f"every {fields['interval']}s"
    else:
        text = f"once at {text_value(fields.get('run_at'))}"
    if fields.get("max_runs") == 1:
        text += ", one-off"
    return text if fields.get("enabled") else f"{text}, disabled"

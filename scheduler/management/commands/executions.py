"""``manage.py executions``: list and inspect executions, retry finished ones, cancel unfinished ones."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from scheduler.celery_app import celery_app
from scheduler.exceptions import SchedulerError
from scheduler.management.base import (
    BIGINT_MAX,
    SchedulerCommand,
    find_schedule,
    model_fields,
    non_negative_int,
    parse_iso,
    sent_text,
    text_table,
    text_value,
    whole_number,
)
from scheduler.models import Execution
from scheduler.ops import audit, operations
from scheduler.tenancy import EVERY_TENANT


class Command(SchedulerCommand):
    help = """List and inspect executions; retry finished ones, cancel unfinished ones.

examples:
  manage.py executions list --status failed --since 2026-03-01
  manage.py executions list --trigger manual
  manage.py executions show 42
  manage.py executions retry 42
  manage.py executions cancel 43 --dry-run
Run "manage.py executions ACTION --help" for the options of each action."""
    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        # Sub-parsers need the one-line errors too; the base gives them to the top
        # parser only after add_arguments() has run, so they would not inherit them.
        subs = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        def action(name: str, summary: str, examples: str) -> CommandParser:
            sub = subs.add_parser(
                name,
                help=summary,
                description=f"{summary}\n\nexamples:\n{examples}",
                formatter_class=parser.formatter_class,
            )
            if name == "list":
                sub.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
                return sub
            sub.add_argument("execution_id", type=whole_number(0, BIGINT_MAX), metavar="ID", help="the execution's id")
            if name == "show":
                sub.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
            else:
                self.add_common_arguments(sub)
            return sub

        listing = action(
            "list",
            "List executions, newest first.",
            "  manage.py executions list\n"
            "  manage.py executions list --schedule nightly --status failed --limit 10\n"
            "  manage.py executions list --since 2026-03-29T00:00:00Z --json",
        )
        listing.add_argument("--status", choices=Execution.Status.values, help="only executions in this status")
        listing.add_argument("--trigger", choices=Execution.Trigger.values, help="only executions with this trigger")
        listing.add_argument("--schedule", metavar="NAME", help="only executions of this schedule")
        listing.add_argument("--since", metavar="ISO", help="only executions scheduled at or after this time")
        listing.add_argument(
            "--limit", type=non_negative_int, default=50, metavar="N", help="at most N rows (default 50; 0 for all)"
        )
        action("show", "Show every field of one execution.", "  manage.py executions show 42 --json")
        action(
            "retry",
            "Run a finished (or lost) execution again, as a new execution linked to it.",
            "  manage.py executions retry 42\n  manage.py executions retry 42 --dry-run",
        )
        action(
            "cancel",
            "Cancel a pending, queued, running or retrying execution and terminate its task.",
            "  manage.py executions cancel 43",
        )

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        try:
            getattr(self, f"_{action}")(**options)
        except SchedulerError as exc:
            raise CommandError(str(exc)) from None

    def _list(
        self,
        *,
        json: bool,
        status: str | None,
        trigger: str | None,
        schedule: str | None,
        since: str | None,
        limit: int,
        **options: Any,
    ) -> None:
        executions = Execution.objects.select_related("schedule")
        if status:
            executions = executions.filter(status=status)
        if trigger:
            executions = executions.filter(trigger=trigger)
        if schedule is not None:
            executions = executions.filter(schedule=find_schedule(schedule))
        if since is not None:
            executions = executions.filter(scheduled_for__gte=parse_iso(since, name="--since"))
        rows = list(executions[:limit] if limit else executions)
        data = [
            {
                "id": e.pk,
                "status": e.status,
                "trigger": e.trigger,
                "scheduled_for": e.scheduled_for,
                "task": e.task,
                "schedule": e.schedule.name if e.schedule else None,
                "attempt": e.attempt,
                "finished_at": e.finished_at,
            }
            for e in rows
        ]
        columns = ("id", "status", "trigger", "scheduled_for", "task", "schedule", "attempt")
        headers = tuple(column.replace("_", " ").upper() for column in columns)
        cells = [tuple(text_value(row[column]) for column in columns) for row in data]
        self.emit(data, as_json=json, text=text_table(headers, cells) if rows else "No executions.")

    def _show(self, execution_id: int, *, json: bool, **options: Any) -> None:
        execution = _get(execution_id)
        attempts = execution.attempt_history()
        data = {**model_fields(execution), "attempts": attempts}
        lines = [f"{key:<18} {text_value(value)}" for key, value in data.items() if key != "attempts"]
        lines += [
            f"{'schedule name':<18} {text_value(execution.schedule.name if execution.schedule else None)}",
            f"{'duration':<18} {text_value(execution.duration_seconds)}",
        ]
        # Every failed attempt's error, not only the last one in ``error``.
        lines += [f"{'attempt ' + str(a['attempt']) + ' error':<18} {a['error']} ({a['at'] or '-'})" for a in attempts]
        self.emit(data, as_json=json, text=lines)

    def _retry(self, execution_id: int, *, json: bool, dry_run: bool, **options: Any) -> None:
        execution = _get(execution_id)
        if dry_run:
            operations.ensure_retryable(execution)
            operations.ensure_task(celery_app(), execution.task, tenant=execution.tenant, scope=EVERY_TENANT)
            self.emit(
                {"dry_run": True, "retry_of": execution.pk},
                as_json=json,
                text=f"Would retry execution {execution_id} ({execution.task}, {execution.status}) as a new execution.",
            )
            return
        result = operations.retry_execution(execution, app=celery_app(), scope=EVERY_TENANT, actor=audit.CLI)
        retry = result.execution
        text = sent_text(retry, f"retries execution {execution_id}", result.broker_error)
        self.emit(
            {
                "dry_run": False,
                "retry_of": execution.pk,
                "execution": model_fields(retry),
                "broker_error": result.broker_error,
            },
            as_json=json,
            text=text,
        )

    def _cancel(self, execution_id: int, *, json: bool, dry_run: bool, **options: Any) -> None:
        execution = _get(execution_id)
        was = execution.status
        if dry_run:
            operations.ensure_cancellable(execution)
            self.emit(
                {"dry_run": True, "execution": execution.pk, "status": was},
                as_json=json,
                text=f"Would cancel execution {execution_id} ({execution.task}, {was}).",
            )
            return
        result = operations.cancel_execution(execution, app=celery_app(), actor=audit.CLI)
        text = f"Cancelled execution {execution_id} (was {was})."
        if result.broker_error:
            text += f" Its task was not revoked: the broker is unreachable ({result.broker_error})."
            if was == Execution.Status.RUNNING:
                text += " The run in progress goes on, but its outcome is not recorded."
            else:
                text += " No worker will start it."
        self.emit(
            {
                "dry_run": False,
                "execution": model_fields(result.execution),
                "was": was,
                "broker_error": result.broker_error,
            },
            as_json=json,
            text=text,
        )


def _get(execution_id: int) -> Execution:
    execution = Execution.objects.select_related("schedule").filter(pk=execution_id).first()
    if execution is None:
        raise CommandError(f"No execution with id {execution_id}")
    return execution

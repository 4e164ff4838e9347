"""``manage.py schedules``: list, inspect, create, change, pause, delete and fire schedules."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import yaml
from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from scheduler import clock, dbclock, limits
from scheduler.celery_app import celery_app
from scheduler.exceptions import SchedulerError
from scheduler.management.base import (
    SchedulerCommand,
    find_schedule,
    model_fields,
    parse_iso,
    parse_json,
    sent_text,
    text_table,
    text_value,
)
from scheduler.models import Schedule
from scheduler.models.schedule import integer_range
from scheduler.ops import audit, bulk, operations, schedule_files
from scheduler.tenancy import EVERY_TENANT

#: Options of ``create`` and ``update`` that set one model field each: flag, field, argparse keywords.
FIELD_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--task", "task", {"metavar": "NAME", "help": "dotted name of a registered Celery task"}),
    ("--args", "args", {"metavar": "JSON", "help": "positional arguments, a JSON list"}),
    ("--kwargs", "kwargs", {"metavar": "JSON", "help": "keyword arguments, a JSON object"}),
    ("--queue", "queue", {"help": "Celery queue; empty for the default one"}),
    ("--timezone", "timezone", {"metavar": "TZ", "help": "IANA zone the cron is read in (default UTC)"}),
    ("--start", "start_at", {"metavar": "ISO", "help": "no slot before this time"}),
    ("--end", "end_at", {"metavar": "ISO", "help": "no slot after this time"}),
    ("--max-runs", "max_runs", {"type": int, "metavar": "N", "help": "turn off after N runs"}),
    (
        "--exclude-calendars",
        "exclude_calendars",
        {"metavar": "NAMES", "help": "calendars whose days it does not fire on, separated by ; ('' for none)"},
    ),
    ("--only-calendar", "only_calendar", {"metavar": "NAME", "help": "fire only on this calendar's days ('' for any)"}),
    ("--timeout", "timeout", {"type": int, "metavar": "S", "help": "soft time limit per execution, seconds"}),
    ("--overlap", "overlap", {"choices": Schedule.Overlap.values, "help": "when a run is still in flight"}),
    ("--misfire", "misfire", {"choices": Schedule.Misfire.values, "help": "which late slots run"}),
    ("--catchup-window", "catchup_window", {"type": int, "metavar": "S", "help": "older slots are missed"}),
    ("--jitter", "jitter", {"type": int, "metavar": "S", "help": "spread sends over up to S seconds"}),
    ("--dst-gap", "dst_gap", {"choices": Schedule.DstGap.values, "help": "local times that do not exist"}),
    ("--dst-fold", "dst_fold", {"choices": Schedule.DstFold.values, "help": "local times that occur twice"}),
    ("--max-retries", "max_retries", {"type": int, "metavar": "N", "help": "attempts after a failure"}),
    ("--retry-backoff", "retry_backoff", {"type": int, "metavar": "S", "help": "base delay between attempts"}),
    ("--pause-after-failures", "pause_after_failures", {"type": int, "metavar": "N", "help": "circuit breaker"}),
    (
        "--alert-after",
        "alert_after",
        {"type": int, "metavar": "S", "help": "overdue after S seconds without a success"},
    ),
    ("--priority", "priority", {"type": int, "metavar": "N", "help": "message priority"}),
    ("--description", "description", {"metavar": "TEXT", "help": "free text for operators"}),
    ("--tenant", "tenant", {"metavar": "NAME", "help": "owner of the schedule"}),
)
#: Options given as text and parsed in handle(), where a bad value is a one-line CommandError.
VALUE_PARSERS: dict[str, Callable[[str], Any]] = {
    "args": lambda value: _arguments(value, field="args", kind=list),
    "kwargs": lambda value: _arguments(value, field="kwargs", kind=dict),
    "start_at": lambda value: parse_iso(value, name="--start"),
    "end_at": lambda value: parse_iso(value, name="--end"),
    "run_at": lambda value: parse_iso(value, name="--at"),
}
#: Destinations that differ from the field name: Django's own ``args`` option would swallow ``--args``.
OPTION_DESTS = {"args": "task_args", "kwargs": "task_kwargs"}
TIMING_OPTIONS = ("cron", "interval", "run_at")
MAX_FIRE_TIMES = 1000
#: Actions that take one NAME or a --filter (``scheduler.ops.bulk``).
BULK_ACTIONS = ("enable", "disable", "pause", "resume", "run-now")


class Command(SchedulerCommand):
    help = """Manage schedules: list, inspect, create, change, pause, delete, fire, export and import them.

examples:
  manage.py schedules list
  manage.py schedules create nightly --task scheduler.echo --cron "0 2 * * *" --timezone Europe/Berlin
  manage.py schedules update nightly --every 3600
  manage.py schedules pause nightly --reason "maintenance until Monday"
  manage.py schedules run-now nightly
  manage.py schedules next nightly -n 10
Run "manage.py schedules ACTION --help" for the options of each action."""
    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        # Sub-parsers need the one-line errors too; the base gives them to the top
        # parser only after add_arguments() has run, so they would not inherit them.
        subs = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        def action(name: str, summary: str, examples: str, *, writes: bool = True) -> CommandParser:
            sub = subs.add_parser(
                name,
                help=summary,
                description=f"{summary}\n\nexamples:\n{examples}",
                formatter_class=parser.formatter_class,
            )
            if name in BULK_ACTIONS:
                sub.add_argument("name", metavar="NAME", nargs="?", help="the schedule's name (or --filter)")
                sub.add_argument(
                    "--filter",
                    dest="filters",
                    action="append",
                    metavar="KEY=VALUE",
                    help="every schedule that matches, in batches, instead of one NAME: name (* and ? match), "
                    "task, queue, tenant, last_status, overdue (true/false); repeat to narrow",
                )
            elif name not in ("list", "export", "import"):
                sub.add_argument("name", metavar="NAME", help="the schedule's name")
            if writes:
                self.add_common_arguments(sub)
            else:
                sub.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
            return sub

        listing = action(
            "list",
            "List every schedule with its timing, state, next run and whether it is overdue.",
            "  manage.py schedules list\n  manage.py schedules list --json\n  manage.py schedules list --overdue",
            writes=False,
        )
        listing.add_argument(
            "--overdue",
            action="store_true",
            help="only schedules without a success for longer than their alert window (dead man's switch)",
        )
        action("show", "Show every field of one schedule.", "  manage.py schedules show nightly --json", writes=False)
        create = action(
            "create",
            "Create a schedule; it is validated like in the admin and nothing is saved on error.",
            '  manage.py schedules create nightly --task scheduler.echo --cron "0 2 * * *" --timezone Europe/Berlin\n'
            "  manage.py schedules create poll --task scheduler.echo --every 30 --args '[1, \"two\"]' --overlap skip\n"
            "  manage.py schedules create once --task scheduler.echo --at 2026-03-29T02:30:00Z --dry-run\n"
            "  manage.py schedules create now --task scheduler.echo --run-now",
        )
        _add_field_options(create, creating=True)
        create.add_argument("--disabled", action="store_true", help="create it turned off")
        update = action(
            "update",
            "Change the given fields; --cron, --every or --at replaces the timing.",
            '  manage.py schedules update nightly --cron "30 3 * * *"\n'
            "  manage.py schedules update nightly --queue reports --timeout 600 --dry-run",
        )
        _add_field_options(update, creating=False)
        action(
            "enable",
            "Turn a schedule on; it fires from its next slot after now.",
            "  manage.py schedules enable nightly\n  manage.py schedules enable --filter queue=reports --dry-run",
        )
        action("disable", "Turn a schedule off, keeping its history.", "  manage.py schedules disable nightly")
        pause = action(
            "pause",
            "Pause a schedule with a reason; slots during the pause are not owed later.",
            '  manage.py schedules pause nightly --reason "vendor outage"\n'
            '  manage.py schedules pause --filter "name=billing-*" --filter tenant=acme --reason "vendor outage"',
        )
        pause.add_argument("--reason", default="", metavar="TEXT", help="why it is paused (default: Paused)")
        action(
            "resume",
            "Resume a paused schedule from its next slot; reset its failure count.",
            "  manage.py schedules resume nightly",
        )
        action(
            "delete",
            "Delete a schedule; its executions keep their history.",
            "  manage.py schedules delete nightly --dry-run",
        )
        run_now = action(
            "run-now",
            "Run a schedule's task once now, outside its timing; optionally with other arguments, queue or priority.",
            "  manage.py schedules run-now nightly\n"
            "  manage.py schedules run-now nightly --args '[\"2026-11-01\"]' --kwargs '{\"full\": true}'",
        )
        for flag, field, keywords in FIELD_OPTIONS:
            if field in operations.RUN_OVERRIDES:
                if keywords.get("type") is int:
                    keywords = {**keywords, "type": _field_number(field)}
                help_text = f"{keywords['help']}, for this run only"
                run_now.add_argument(flag, dest=OPTION_DESTS.get(field, field), **{**keywords, "help": help_text})
        exporting = action(
            "export",
            "Print the schedules' definitions as YAML (for `schedules import`): what an operator sets, no run state.",
            "  manage.py schedules export > schedules.yaml\n  manage.py schedules export --tenant acme",
            writes=False,
        )
        exporting.add_argument("--tenant", metavar="NAME", help="only this tenant's schedules ('' for the deployer's)")
        importing = action(
            "import",
            "Make the schedules say what a YAML file says (created, changed field by field); print the changes. "
            "A file with one bad entry changes nothing; importing it twice changes nothing the second time.",
            "  manage.py schedules import schedules.yaml --dry-run\n"
            "  manage.py schedules import schedules.yaml --prune\n"
            "  manage.py schedules export | ssh other-host manage.py schedules import -",
        )
        importing.add_argument("file", metavar="FILE", help="a file `schedules export` wrote; - reads standard input")
        importing.add_argument(
            "--prune", action="store_true", help="also turn off the enabled schedules the file does not name"
        )
        importing.add_argument(
            "--tenant",
            metavar="NAME",
            help="only this tenant's schedules: other entries are refused, --prune looks at it only",
        )
        upcoming = action(
            "next",
            "Print the next fire times in the schedule's zone and in UTC.",
            "  manage.py schedules next nightly -n 10",
            writes=False,
        )
        upcoming.add_argument(
            "-n",
            "--count",
            type=_fire_count,
            default=5,
            metavar="N",
            help=f"how many (1 to {MAX_FIRE_TIMES}, default 5)",
        )

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        try:
            if action in BULK_ACTIONS and (options.get("filters") or not options.get("name")):
                self._bulk(action.replace("-", "_"), **options)
            else:
                getattr(self, "_" + action.replace("-", "_"))(**options)
        except SchedulerError as exc:
            raise CommandError(str(exc)) from None

    def _bulk(
        self, action: str, *, name: str | None, filters: list[str] | None, json: bool, dry_run: bool, **options: Any
    ) -> None:
        if name is not None:
            raise CommandError("give one NAME or --filter, not both")
        if not filters:
            raise CommandError("give the schedule's NAME, or --filter KEY=VALUE for every schedule that matches")
        if _changes(options):
            raise CommandError("--args, --kwargs, --queue and --priority apply to one schedule's run, not to --filter")
        report = operations.bulk_action(
            action,
            bulk.Filter.from_mapping(_filter(filters)),
            app=celery_app(),
            scope=EVERY_TENANT,
            actor=audit.CLI,
            reason=options.get("reason") or "",
            dry_run=dry_run,
        )
        verb = action.replace("_", " ")
        shown = ", ".join(report.first_names) + (", …" if report.matched > len(report.first_names) else "")
        if dry_run:
            text = f"Would {verb} {report.changed} of {report.matched} matching schedule(s)"
        else:
            done = "ran" if action == "run_now" else f"{verb}d"
            text = f"{done.capitalize()} {report.changed} of {report.matched} matching schedule(s)"
        lines = [text + (f": {shown}" if shown else ".")]
        if report.broker_error:
            lines.append(f"Not sent yet ({report.broker_error}): the beat leader sends them once the broker is back.")
        self.emit(asdict(report), as_json=json, text=lines)

    # --- reading ---------------------------------------------------------------------

    def _list(self, *, json: bool, overdue: bool, **options: Any) -> None:
        now = dbclock.now()  # the clock the finish path stamps successes with
        schedules = list(Schedule.objects.overdue(now=now) if overdue else Schedule.objects.all())
        late = {s.pk for s in schedules if s.is_overdue_at(now)}
        rows = [
            {
                "name": s.name,
                "task": s.task,
                "timing": timing_text(s),
                "timezone": s.timezone,
                "enabled": s.enabled,
                "paused_reason": s.paused_reason,
                "next_run_at": s.next_run_at,
                "last_success_at": s.last_success_at,
                "overdue": s.pk in late,
            }
            for s in schedules
        ]
        headers = ("NAME", "TASK", "TIMING", "TIMEZONE", "STATE", "NEXT RUN", "LAST SUCCESS", "OVERDUE")
        cells = [
            (
                s.name,
                s.task,
                timing_text(s),
                s.timezone,
                state_text(s),
                text_value(s.next_run_at),
                text_value(s.last_success_at),
                "OVERDUE" if s.pk in late else "",
            )
            for s in schedules
        ]
        empty = "No overdue schedules." if overdue else "No schedules."
        self.emit(rows, as_json=json, text=text_table(headers, cells) if schedules else empty)

    def _show(self, name: str, *, json: bool, **options: Any) -> None:
        schedule = _get(name)
        data = model_fields(schedule)
        lines = [f"{key:<22} {text_value(value)}" for key, value in data.items()]
        lines += [f"{'timing':<22} {timing_text(schedule)}", f"{'state':<22} {state_text(schedule)}"]
        self.emit(data, as_json=json, text=lines)

    def _export(self, *, json: bool, tenant: str | None, **options: Any) -> None:
        chosen = Schedule.objects.order_by("tenant", "name")
        if tenant is not None:
            chosen = chosen.filter(tenant=tenant)
        text = schedule_files.export(chosen)
        self.emit(yaml.safe_load(text), as_json=json, text=text.rstrip("\n"))

    def _next(self, name: str, *, json: bool, count: int, **options: Any) -> None:
        schedule = _get(name)
        times = schedule.next_fire_times(count, after=clock.now())
        zone = ZoneInfo(schedule.timezone)
        data = [{"local": t.astimezone(zone), "utc": t} for t in times]
        lines = [
            f"{t.astimezone(zone):%a %Y-%m-%d %H:%M:%S %Z}  ({t:%Y-%m-%d %H:%M:%S} UTC)"
            + (f"  not fired: excluded by calendar {calendar}" if calendar else "")
            for t, calendar in schedule.preview_fire_times(count, after=clock.now())
            if not times or t <= times[-1]
        ]
        if not times:
            lines = ["No upcoming slots."]
        if not schedule.enabled or schedule.is_paused:
            lines.append(f"Note: the schedule is {state_text(schedule)}; it does not fire until turned on.")
        self.emit(data, as_json=json, text=lines)

    # --- writing ---------------------------------------------------------------------

    def _create(self, name: str, *, json: bool, dry_run: bool, disabled: bool, run_now: bool, **options: Any) -> None:
        changes = _changes(options)
        now = dbclock.now()
        if run_now:
            changes.update(cron="", interval=None, run_at=now)
        schedule = Schedule(name=name, enabled=not disabled, **changes)
        operations.validate_schedule(schedule, app=celery_app(), scope=EVERY_TENANT)
        operations.ensure_run_at_ahead(
            schedule.run_at, now=now, hint="Give a future time, or use --run-now (instead of --at) to run it now."
        )
        operations.ensure_end_at_ahead(schedule.end_at, now=now)
        if dry_run:
            schedule.next_run_at = schedule.compute_next_run_at(now=clock.now())
        else:
            operations.save_schedule(schedule, actor=audit.CLI, now=dbclock.now())
        self._report(schedule, "Would create" if dry_run else "Created", json=json, dry_run=dry_run)

    def _update(self, name: str, *, json: bool, dry_run: bool, **options: Any) -> None:
        schedule = _get(name)
        changes = _changes(options)
        if not changes:
            raise CommandError("Nothing to change: give at least one option, e.g. --cron or --queue.")
        for field, value in changes.items():
            setattr(schedule, field, value)
        operations.validate_schedule(schedule, app=celery_app(), scope=EVERY_TENANT)
        changed, now = schedule.changed_fields(), dbclock.now()
        if "run_at" in changed:
            operations.ensure_run_at_ahead(
                schedule.run_at,
                now=now,
                hint=f"Give a future time; to run the task once now, use: schedules run-now {name}",
            )
        if "end_at" in changed:
            operations.ensure_end_at_ahead(schedule.end_at, now=now)
        with _rolled_back_if(dry_run):
            operations.save_schedule(schedule, actor=audit.CLI, now=dbclock.now())
        self._report(schedule, "Would update" if dry_run else "Updated", json=json, dry_run=dry_run)

    def _enable(self, name: str, **options: Any) -> None:
        self._change_state(name, "enable", partial(operations.set_schedule_enabled, enabled=True), **options)

    def _disable(self, name: str, **options: Any) -> None:
        self._change_state(name, "disable", partial(operations.set_schedule_enabled, enabled=False), **options)

    def _pause(self, name: str, *, reason: str, **options: Any) -> None:
        self._change_state(name, "pause", partial(operations.pause_schedule, reason=reason), **options)

    def _resume(self, name: str, **options: Any) -> None:
        self._change_state(name, "resume", operations.resume_schedule, **options)

    def _change_state(
        self, name: str, verb: str, change: Callable[..., None], *, json: bool, dry_run: bool, **options: Any
    ) -> None:
        schedule = _get(name)
        with _rolled_back_if(dry_run):
            change(schedule, actor=audit.CLI, now=dbclock.now())
        self._report(schedule, f"Would {verb}" if dry_run else f"{verb.capitalize()}d", json=json, dry_run=dry_run)

    def _delete(self, name: str, *, json: bool, dry_run: bool, **options: Any) -> None:
        schedule = _get(name)
        data = model_fields(schedule)
        kept = schedule.executions.count()
        with _rolled_back_if(dry_run):
            operations.delete_schedule(schedule, actor=audit.CLI)
        verb = "Would delete" if dry_run else "Deleted"
        self.emit(
            {"dry_run": dry_run, "schedule": data, "executions_kept": kept},
            as_json=json,
            text=f"{verb} schedule {name!r}; its {kept} execution(s) keep their history.",
        )

    def _import(self, *, file: str, json: bool, dry_run: bool, prune: bool, tenant: str | None, **options: Any) -> None:
        text = _read(file)
        changes = schedule_files.import_file(
            text, app=celery_app(), actor=audit.CLI, tenant=tenant, prune=prune, dry_run=dry_run
        )
        counts = Counter(change.verb for change in changes)
        summary = ", ".join(f"{counts[verb]} {verb}d" for verb in ("create", "update", "disable"))
        lines = [_change_line(change) for change in changes if change.verb != "unchanged"]
        lines.append(("Would make: " if dry_run else "") + f"{summary}, {counts['unchanged']} unchanged.")
        self.emit(
            {"dry_run": dry_run, "changes": [asdict(change) for change in changes], "counts": dict(counts)},
            as_json=json,
            text=lines,
        )

    def _run_now(self, name: str, *, json: bool, dry_run: bool, **options: Any) -> None:
        schedule = _get(name)
        overrides = _changes(options)
        if dry_run:
            operations.check_run_overrides(schedule, overrides)
            operations.ensure_task(celery_app(), schedule.task, tenant=schedule.tenant, scope=EVERY_TENANT)
            self.emit(
                {"dry_run": True, "schedule": schedule.name, "task": schedule.task, "overrides": overrides},
                as_json=json,
                text=f"Would run schedule {name!r} now (task {schedule.task}"
                + "".join(f", {field} {text_value(value)}" for field, value in overrides.items())
                + ").",
            )
            return
        result = operations.run_now(
            schedule, app=celery_app(), scope=EVERY_TENANT, actor=audit.CLI, overrides=overrides
        )
        execution = result.execution
        text = sent_text(execution, f"of schedule {name!r}", result.broker_error)
        self.emit(
            {"dry_run": False, "execution": model_fields(execution), "broker_error": result.broker_error},
            as_json=json,
            text=text,
        )

    def _report(self, schedule: Schedule, verb: str, *, json: bool, dry_run: bool) -> None:
        text = (
            f"{verb} schedule {schedule.name!r}: {timing_text(schedule)} ({schedule.timezone}), "
            f"{state_text(schedule)}, next run {text_value(schedule.next_run_at)}."
        )
        self.emit({"dry_run": dry_run, "schedule": model_fields(schedule)}, as_json=json, text=text)


def timing_text(schedule: Schedule) -> str:
    """Return the schedule's timing in words: ``cron 0 2 * * *``, ``every 30s`` or ``once at ...``."""
    if schedule.cron:
        return f"cron {schedule.cron}"
    if schedule.interval is not None:
        return f"every {schedule.interval}s"
    if schedule.run_at is not None:
        return f"once at {text_value(schedule.run_at)}"
    return "no timing"


def state_text(schedule: Schedule) -> str:
    """Return ``enabled``, ``paused (reason)`` or ``disabled`` (with the reason it turned itself off)."""
    if not schedule.enabled:
        return f"disabled ({schedule.disabled_reason})" if schedule.disabled_reason else "disabled"
    if schedule.is_paused:
        return f"paused ({schedule.paused_reason})"
    return "enabled"


def _add_field_options(parser: CommandParser, *, creating: bool) -> None:
    timing = parser.add_mutually_exclusive_group(required=creating)
    timing.add_argument("--cron", metavar="EXPR", help='5 fields, or 6 with seconds first: "*/10 * * * * *"')
    timing.add_argument(
        "--every", dest="interval", type=_field_number("interval"), metavar="SECONDS", help="fixed interval"
    )
    timing.add_argument("--at", dest="run_at", metavar="ISO", help="run once at this time (not in the past)")
    if creating:
        timing.add_argument(
            "--run-now", action="store_true", help="run once now: a one-off whose time is now (database clock)"
        )
    for flag, field, keywords in FIELD_OPTIONS:
        dest = OPTION_DESTS.get(field, field)
        if keywords.get("type") is int:
            keywords = {**keywords, "type": _field_number(field)}
        parser.add_argument(flag, dest=dest, required=creating and field == "task", **keywords)


def _filter(given: list[str]) -> dict[str, Any]:
    """Parse ``--filter KEY=VALUE`` options; ``overdue`` takes true or false."""
    criteria: dict[str, Any] = {}
    for item in given:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise CommandError(f"--filter {item!r}: expected KEY=VALUE, for example name=nightly-*")
        if key == "overdue":
            if value.lower() not in ("true", "false"):
                raise CommandError(f"--filter overdue={value}: expected true or false")
            criteria[key] = value.lower() == "true"
        else:
            criteria[key] = value
    return criteria


def _read(file: str) -> str:
    """Return the text of ``file`` (``-``: standard input); a file that cannot be read is a one-line error."""
    if file == "-":
        return sys.stdin.read()
    try:
        return Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {file}: {exc}") from None


def _change_line(change: schedule_files.Change) -> str:
    """One line of an import's diff: ``+ name`` created, ``~ name: field a -> b`` changed, ``- name`` turned off."""
    who = f"{change.tenant}/{change.name}" if change.tenant else change.name
    if change.verb == "create":
        return f"+ {who}"
    if change.verb == "disable":
        return f"- {who} (turned off: not in the file)"
    edits = "; ".join(f"{field} {text_value(old)} -> {text_value(new)}" for field, (old, new) in change.fields.items())
    return f"~ {who}: {edits}"


def _get(name: str) -> Schedule:
    return find_schedule(name)


def _changes(options: dict[str, Any]) -> dict[str, Any]:
    """Return {field: value} for the field options given on the command line, parsed."""
    fields = (*TIMING_OPTIONS, *(field for _, field, _ in FIELD_OPTIONS))
    given = {field: options.get(OPTION_DESTS.get(field, field)) for field in fields}
    changes = {field: value for field, value in given.items() if value is not None}
    if any(field in changes for field in TIMING_OPTIONS):
        # One timing replaces the others: a schedule has exactly one.
        changes = {"cron": "", "interval": None, "run_at": None, **changes}
    for field, parse in VALUE_PARSERS.items():
        if changes.get(field) is not None:
            changes[field] = parse(changes[field])
    return changes


@contextmanager
def _rolled_back_if(dry_run: bool) -> Iterator[None]:
    """Run the block in a transaction, rolled back for a dry run so the output shows the outcome."""
    with transaction.atomic():
        yield
        transaction.set_rollback(dry_run)


def _arguments(value: str, *, field: str, kind: type) -> Any:
    """Parse ``--args``/``--kwargs``; refuse, as the model's validation would, a value past the argument limits.

    Checked here, before a Schedule holds the value: the model copies its
    JSON fields when built, and that copy recurses.
    """
    parsed = parse_json(value, name=f"--{field}", kind=kind)
    problem = limits.argument_problem(parsed, label=limits.ARGUMENT_LABELS[field])
    if problem:
        raise CommandError(f"{field}: {problem}")
    return parsed


def _field_number(field: str) -> Callable[[str], int]:
    """Return the argparse type of an integer field: a whole number its column can hold.

    A number below the field's minimum gets through to the model's validation,
    whose message names the field.
    """
    low, high = integer_range(field)

    def parse(value: str) -> int:
        number = int(value)  # argparse reports a ValueError as "invalid int value: ..."
        if number > high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; expected {low} to {high}")
        return number

    parse.__name__ = "int"
    return parse


def _fire_count(value: str) -> int:
    """argparse type: how many fire times to print, 1 to ``MAX_FIRE_TIMES``."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if not 1 <= count <= MAX_FIRE_TIMES:
        raise argparse.ArgumentTypeError(f"{value} is out of range; expected 1 to {MAX_FIRE_TIMES}")
    return count

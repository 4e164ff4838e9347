"""``manage.py backfill``: record and send the past slots of a schedule that have no execution."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any
from zoneinfo import ZoneInfo

from django.core.management.base import CommandError, CommandParser

from scheduler.exceptions import BackfillRefused, BackfillTooLarge
from scheduler.management.base import (
    SchedulerCommand,
    find_schedule,
    non_negative_int,
    parse_iso,
    positive_number,
    whole_number,
)
from scheduler.ops import audit, operations
from scheduler.ops.backfill import DEFAULT_LIMIT, BackfillReport


class Command(SchedulerCommand):
    help = f"""Run a schedule's past slots in a range: one execution per slot that has none.

Slots get the same idempotency keys the beat uses, so a slot that already
has an execution (run, missed, skipped...) is left alone and running the same
backfill again creates nothing. The range is inclusive, must lie in the past,
and may hold at most --limit slots (default {DEFAULT_LIMIT}), and never more
than SCHEDULER_BACKFILL_MAX_SLOTS unless --max-slots raises that cap for this
call. Times without a zone are UTC.

examples:
  manage.py backfill nightly-report --start 2026-03-01 --end 2026-03-08 --dry-run
  manage.py backfill nightly-report --start 2026-03-01T00:00:00Z --end 2026-03-08T00:00:00Z
  manage.py backfill sync --start 2026-03-01 --end 2026-03-02 --limit 5000 --rate 20
  manage.py backfill sync --start 2026-01-01 --end 2026-03-01 --max-slots 50000 --rate 100"""

    writes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("schedule", metavar="NAME", help="name of the schedule")
        parser.add_argument("--start", required=True, metavar="ISO", help="first instant of the range (inclusive)")
        parser.add_argument(
            "--end", required=True, metavar="ISO", help="last instant of the range (inclusive, in the past)"
        )
        parser.add_argument(
            "--limit",
            type=non_negative_int,
            metavar="N",
            help=f"refuse a range holding more than N slots (default {DEFAULT_LIMIT}, or --max-slots when given)",
        )
        parser.add_argument(
            "--max-slots",
            type=whole_number(1),
            metavar="N",
            help="raise the cap on slots one backfill may record (SCHEDULER_BACKFILL_MAX_SLOTS) to N for this call",
        )
        parser.add_argument(
            "--rate", type=positive_number, metavar="PER_SECOND", help="send at most this many per second"
        )
        self.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        start = parse_iso(options["start"], name="--start")
        end = parse_iso(options["end"], name="--end")
        schedule = find_schedule(options["schedule"])
        as_json = options["json"]
        max_slots = options["max_slots"]
        # --limit, else the raised cap, else the default: --max-slots alone allows that many.
        limit = options["limit"] if options["limit"] is not None else max_slots or DEFAULT_LIMIT
        try:
            report = operations.backfill_range(
                schedule,
                actor=audit.CLI,
                start=start,
                end=end,
                dry_run=options["dry_run"],
                limit=limit,
                max_slots=max_slots,
                rate=options["rate"],
                progress=None
                if as_json
                else lambda done, total: self.stderr.write(f"{done}/{total} slots recorded and sent..."),
            )
        except BackfillTooLarge as exc:
            hint = "; to record more in this call, pass --max-slots N" if exc.capped else ""
            raise CommandError(f"{exc}{hint}") from None
        except BackfillRefused as exc:
            raise CommandError(str(exc)) from None
        self.emit(asdict(report), as_json=as_json, text=_lines(report, ZoneInfo(schedule.timezone)))
        if report.not_recorded:
            raise CommandError(
                f"{report.not_recorded} slot(s) not recorded: the broker is unreachable; "
                "run the same backfill again once it is back"
            )


def _lines(report: BackfillReport, zone: ZoneInfo) -> list[str]:
    span = (
        f"{len(report.slots)} slot(s) of {report.schedule} from {report.start.isoformat()} to {report.end.isoformat()}"
    )
    if not report.dry_run:
        lines = [
            f"{span}: {report.created} recorded, {report.published} sent, "
            f"{report.already_present} already had an execution"
        ]
        if report.broker_error:
            lines.append(
                f"the broker is unreachable ({report.broker_error}): the {report.created - report.published} "
                "recorded but not sent stay pending; the beat leader sends them once it is back"
            )
        return lines
    lines = []
    for state in report.slots:
        local = state.scheduled_for.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z")
        has = (
            f"has execution {state.execution_id} ({state.status})"
            if state.execution_id
            else "missing, would be recorded"
        )
        lines.append(f"{local}  {state.scheduled_for.isoformat()}  {has}")
    missing = len(report.slots) - report.already_present
    lines.append(
        f"dry run, nothing changed: {span}: {missing} would be recorded, {report.already_present} already have one"
    )
    return lines

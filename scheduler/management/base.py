"""What every scheduler command shares: one-line errors, ``--json`` output, argument parsers.

Commands stay thin: they parse arguments with the helpers below, call the
domain (models, ``dispatch``, ``reconcile``, ``backfill``) and print what it
returns. Any refusal becomes a ``CommandError`` with one line a human can act
on; Django prints it and exits with status 1. Argument errors exit with 2.
With ``--json`` the same line is also printed on stdout as
``{"error": "..."}``, so a script parses one stream either way.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper, SystemCheckError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError
from django.db.models import Model
from django.utils.dateparse import parse_datetime

from scheduler.exceptions import BrokerUnavailable, SchedulerError, first_line, validation_message
from scheduler.limits import holds_unstorable_text
from scheduler.models import Execution
from scheduler.models.schedule import EARLIEST, LATEST, Schedule

#: ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` (a number and one unit).
_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: Longest duration accepted: a cutoff further back than this cannot be a date.
MAX_DURATION_DAYS = 36_500
#: Largest number a seconds or rate option takes (about 31 years of seconds).
MAX_NUMBER = 1e9
#: Largest value of a PostgreSQL ``integer`` and ``bigint`` column.
INT_MAX = 2_147_483_647
BIGINT_MAX = 9_223_372_036_854_775_807


class OneLineParser(CommandParser):
    """An argument parser whose errors are one line on stderr (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        message = one_line(message)
        if getattr(self, "called_from_command_line", False):
            self.exit(2, f"{self.prog}: error: {message}\n")
        raise CommandError(f"Error: {message}")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        # A shell cannot pass a NUL, but a caller's list can, and no database
        # column stores one (PostgreSQL refuses it in any text); bytes that are
        # not UTF-8 reach Python as lone surrogates, which no text holds.
        if args is not None and holds_unstorable_text(list(args)):
            self.error("arguments cannot contain NUL characters or bytes that are not UTF-8")
        return super().parse_known_args(args, namespace)


class SchedulerCommand(BaseCommand):
    """Base of the scheduler's commands: ``--json``, one-line errors, infrastructure errors wrapped."""

    #: Commands that write get ``--dry-run``.
    writes = False

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", _ExamplesFormatter)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_base_argument(self, parser: CommandParser, *args: Any, **kwargs: Any) -> None:
        # Django builds a plain CommandParser with no hook for its class; this
        # runs before add_arguments(), so sub-parsers made there inherit the
        # one-line errors too (argparse gives them the parent's class).
        parser.__class__ = OneLineParser
        super().add_base_argument(parser, *args, **kwargs)

    def add_common_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        if self.writes:
            parser.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")

    def run_from_argv(self, argv: list[str]) -> None:
        """Run from the command line; with ``--json`` an error is also ``{"error": "..."}`` on stdout.

        The exit status and the line on stderr stay as without ``--json``.
        """
        if "--json" not in argv[2:]:
            super().run_from_argv(argv)
            return
        captured = io.StringIO()
        stderr, self.stderr = self.stderr, OutputWrapper(captured)
        try:
            # argparse prints its usage errors to sys.stderr, Django its CommandError to self.stderr.
            with contextlib.redirect_stderr(captured):
                super().run_from_argv(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                self.stdout.write(json.dumps({"error": _error_text(captured.getvalue())}))
            raise
        finally:
            self.stderr = stderr
            sys.stderr.write(captured.getvalue())

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute(*args, **options)
        except SystemCheckError:
            raise  # Django's own report, one problem per line
        except CommandError as exc:
            raise CommandError(one_line(str(exc)), returncode=exc.returncode) from None
        except ValidationError as exc:
            raise CommandError(one_line(validation_message(exc))) from None
        except DatabaseError as exc:
            raise CommandError(f"database error: {first_line(exc)}") from None
        except BrokerUnavailable as exc:
            raise CommandError(f"broker unreachable: {first_line(exc)}") from None
        except SchedulerError as exc:  # an action refused, with the reason an operator reads
            raise CommandError(one_line(str(exc))) from None

    def emit(self, data: Any, *, as_json: bool, text: str | list[str] = "") -> None:
        """Print ``data`` as JSON, or ``text`` (a string or lines) for humans."""
        if as_json:
            self.stdout.write(json.dumps(data, cls=DjangoJSONEncoder, indent=2, sort_keys=True))
        elif isinstance(text, list):
            for line in text:
                self.stdout.write(line)
        elif text:
            self.stdout.write(text)


class _ExamplesFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the line breaks of ``help`` texts, so the examples in them stay readable."""


def _error_text(printed: str) -> str:
    """Return the message of the error line Django or argparse printed, without its prefix."""
    lines = [line for line in printed.splitlines() if line.strip()]
    last = lines[-1] if lines else "error"
    for prefix in ("CommandError: ", "error: "):
        if prefix in last:
            return last.split(prefix, 1)[1]
    return last


def one_line(text: str) -> str:
    """Return ``text`` with line breaks and other unprintable characters escaped, as in a repr."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def parse_iso(value: str, *, name: str = "date") -> datetime:
    """Parse an ISO-8601 date or datetime; naive values are UTC. Raise CommandError otherwise.

    A date that does not exist (``2026-02-30``) is refused, and so is one outside
    the span schedules may name (``EARLIEST`` to ``LATEST``).
    """
    text = value.strip()
    try:
        # parse_datetime returns None for a shape it does not know, and raises
        # for a known shape with an impossible date.
        parsed = parse_datetime(text) or datetime.fromisoformat(text)
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        parsed = parsed.astimezone(timezone.utc)
    except (ValueError, OverflowError) as exc:
        # Say why a well-shaped value is wrong (``day is out of range for month``);
        # for other text the reason would only repeat the value.
        reason = "" if "isoformat" in str(exc) else f" ({first_line(exc)})"
        raise CommandError(
            f"{name} {value!r} is not an ISO-8601 date or time{reason}, e.g. 2026-03-29T02:30:00Z"
        ) from None
    if not EARLIEST <= parsed < LATEST:
        raise CommandError(f"{name} {value!r} is out of range; expected a time from 1970-01-01 to 8999-12-31")
    return parsed


def parse_duration(value: str, *, name: str = "duration") -> timedelta:
    """Parse ``30d``, ``12h``, ``90m``, ``45s`` or ``2w``. Raise CommandError otherwise."""
    match = _DURATION.match(value)
    if not match:
        raise CommandError(f"{name} {value!r} is not a duration like 30d, 12h, 90m or 45s")
    # Thousands of digits would make int() itself refuse; anything that long is out of range.
    seconds = int(match[1]) * _UNIT_SECONDS[match[2]] if len(match[1]) <= 15 else math.inf
    if seconds > MAX_DURATION_DAYS * 86400:
        raise CommandError(f"{name} {value!r} is out of range; expected at most {MAX_DURATION_DAYS}d (100 years)")
    return timedelta(seconds=seconds)


def parse_json(value: str, *, name: str, kind: type) -> Any:
    """Parse a JSON argument that must be a ``list`` or a ``dict``. Raise CommandError otherwise."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise CommandError(f"{name} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise CommandError(f"{name} is not valid JSON: nested too deeply") from None
    if not isinstance(parsed, kind):
        expected = 'a JSON list, e.g. [1, "two"]' if kind is list else 'a JSON object, e.g. {"key": 1}'
        raise CommandError(f"{name} must be {expected}")
    return parsed


def whole_number(low: int = 0, high: int = INT_MAX) -> Callable[[str], int]:
    """Return an argparse type: an integer from ``low`` to ``high`` (a one-line error otherwise)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise _argument_error(f"{value!r} is not a whole number") from None
        if number < 0 and low == 0:
            raise _argument_error(f"{value} is negative; expected 0 or more")
        if not low <= number <= high:
            raise _argument_error(f"{value} is out of range; expected {low} to {high}")
        return number

    return parse


#: argparse type: a count or limit, 0 to the largest ``integer`` a column holds.
non_negative_int = whole_number(0, INT_MAX)


def positive_number(value: str) -> float:
    """argparse type: a number > 0 and at most ``MAX_NUMBER`` (no ``inf`` or ``nan``)."""
    try:
        number = float(value)
    except ValueError:
        raise _argument_error(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise _argument_error(f"{value!r} is not a finite number")
    if number <= 0:
        raise _argument_error(f"{value} must be greater than 0")
    if number > MAX_NUMBER:
        raise _argument_error(f"{value} is out of range; expected at most {MAX_NUMBER:.0f}")
    return number


def _argument_error(message: str) -> Exception:
    return argparse.ArgumentTypeError(message)


def model_fields(instance: Model) -> dict[str, Any]:
    """Return every stored field of ``instance`` by attribute name (for ``show --json``)."""
    return {field.attname: getattr(instance, field.attname) for field in instance._meta.concrete_fields}


def sent_text(execution: Execution, what: str, broker_error: str | None) -> str:
    """Say what became of an execution an action recorded: ``Execution N <what>: sent``, or still pending and why."""
    if broker_error:
        return (
            f"Execution {execution.pk} {what}: recorded but still pending: the broker is unreachable "
            f"({broker_error}); the beat leader will send it."
        )
    return f"Execution {execution.pk} {what}: {execution.status} (celery id {execution.celery_task_id})."


def text_table(headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Return aligned text lines for a header row and data rows."""
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (headers, *rows)]


def text_value(value: Any) -> str:
    """Return one field value as text: ISO-8601 times, JSON for lists and objects, ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def find_schedule(reference: str) -> Schedule:
    """Return the schedule named ``reference``, or whose id it is; a name several tenants use must be given as an id.

    Names are unique per tenant only, so the command line (which sees every
    tenant) refuses to guess between two schedules of one name.
    """
    named = list(Schedule.objects.filter(name=reference).order_by("tenant")[:10])
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        choices = ", ".join(f"{s.pk} (tenant {s.tenant or '-'})" for s in named)
        raise CommandError(f"{len(named)} schedules are named {reference!r}: give one's id instead: {choices}")
    found = Schedule.objects.filter(pk=int(reference)).first() if reference.isdigit() else None
    if found is None:
        raise CommandError(f"No schedule named {reference!r}")
    return found

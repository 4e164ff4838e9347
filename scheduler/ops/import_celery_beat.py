"""Import django-celery-beat's periodic tasks as Schedules (``manage.py import_celery_beat``).

Its tables are read with plain SQL through a database alias, so moving off
django-celery-beat never needs its package installed. Each periodic task is
imported, left alone because a schedule of that name exists, or refused with
the reason; nothing on django-celery-beat's side is changed, and running the
import again creates nothing new.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils.connection import ConnectionDoesNotExist
from django.utils.dateparse import parse_datetime

from scheduler.exceptions import SchedulerError, validation_message
from scheduler.models import Schedule
from scheduler.ops import audit, operations
from scheduler.tenancy import EVERY_TENANT

if TYPE_CHECKING:
    from celery import Celery
    from django.db.backends.base.base import BaseDatabaseWrapper

TABLE_PREFIX = "django_celery_beat_"
#: Columns read from each of django-celery-beat's tables (2.x schema, prefix left off).
COLUMNS: dict[str, tuple[str, ...]] = {
    "periodictask": (
        "id",
        "name",
        "task",
        "args",
        "kwargs",
        "queue",
        "exchange",
        "routing_key",
        "headers",
        "priority",
        "expires",
        "expire_seconds",
        "one_off",
        "start_time",
        "enabled",
        "total_run_count",
        "description",
        "crontab_id",
        "interval_id",
        "clocked_id",
        "solar_id",
    ),
    "crontabschedule": ("id", "minute", "hour", "day_of_month", "month_of_year", "day_of_week", "timezone"),
    "intervalschedule": ("id", "every", "period"),
    "clockedschedule": ("id", "clocked_time"),
    "solarschedule": ("id", "event", "latitude", "longitude"),
}
#: A periodic task's schedule kinds (its foreign keys) and the table each points at.
KINDS = {
    "crontab": "crontabschedule",
    "interval": "intervalschedule",
    "clocked": "clockedschedule",
    "solar": "solarschedule",
}
#: django-celery-beat's interval periods in microseconds, its smallest one.
_PERIOD_MICROSECONDS = {
    "days": 86_400_000_000,
    "hours": 3_600_000_000,
    "minutes": 60_000_000,
    "seconds": 1_000_000,
    "microseconds": 1,
}
_WHITESPACE = re.compile(r"\s+")

IMPORTED = "imported"
EXISTS = "exists"
REFUSED = "refused"


class CeleryBeatImportRefused(SchedulerError):
    """The import was refused: django-celery-beat's tables cannot be read; nothing was written."""


@dataclass(frozen=True)
class TaskOutcome:
    """What became of one periodic task."""

    name: str
    #: ``imported`` (with ``dry_run``: would be), ``exists`` or ``refused``.
    outcome: str
    #: Why it was refused; empty otherwise.
    reason: str = ""
    #: What the imported schedule could not keep, one sentence each.
    notes: tuple[str, ...] = ()
    #: The fields the schedule got (imported only).
    schedule: dict[str, Any] | None = None


@dataclass(frozen=True)
class ImportReport:
    """Every periodic task's outcome, by name, and how many ended each way."""

    database: str
    dry_run: bool
    tasks: tuple[TaskOutcome, ...]
    counts: dict[str, int]


class _Refused(Exception):
    """One task has no faithful equivalent here; the message says why."""


def import_periodic_tasks(
    *, using: str = DEFAULT_DB_ALIAS, app: Celery, actor: audit.Actor, dry_run: bool = False
) -> ImportReport:
    """Create one Schedule per periodic task in database ``using`` that has an equivalent and no namesake.

    Each schedule is validated like the admin validates it (``full_clean()``
    and a registered task), and audited as an "import" by ``actor``. All are
    created in one transaction, with their events: a database error leaves
    none behind. Raise ``CeleryBeatImportRefused`` when the tables cannot be
    read.
    """
    rows = read_periodic_tasks(using)
    outcomes = []
    with transaction.atomic():
        for row in rows:
            outcomes.append(_import_one(row, app=app, actor=actor, dry_run=dry_run))
    counts = {outcome: sum(1 for o in outcomes if o.outcome == outcome) for outcome in (IMPORTED, EXISTS, REFUSED)}
    return ImportReport(database=using, dry_run=dry_run, tasks=tuple(outcomes), counts=counts)


def read_periodic_tasks(using: str) -> list[dict[str, Any]]:
    """Return every periodic task with its schedule's columns (``crontab__minute``...), by name."""
    try:
        connection = connections[using]
    except ConnectionDoesNotExist:
        raise CeleryBeatImportRefused(f"no database alias {using!r} in DATABASES") from None
    with connection.cursor() as cursor:
        _check_tables(connection, cursor, using)
        cursor.execute(_select_sql(connection))
        labels = [column[0] for column in cursor.description]
        # Sorted here, not in SQL: the database's collation would make the order differ between backends.
        rows = sorted((dict(zip(labels, values)) for values in cursor.fetchall()), key=lambda row: row["name"])
    for row in rows:
        for column in ("expires", "start_time", "clocked__clocked_time"):
            row[column] = _aware(row[column], connection)
    return rows


def _check_tables(connection: BaseDatabaseWrapper, cursor: Any, using: str) -> None:
    present = set(connection.introspection.table_names(cursor))
    missing = [TABLE_PREFIX + table for table in COLUMNS if TABLE_PREFIX + table not in present]
    if len(missing) == len(COLUMNS):
        raise CeleryBeatImportRefused(f"no django-celery-beat tables in database {using!r}")
    if missing:
        raise CeleryBeatImportRefused(
            f"django-celery-beat tables missing in database {using!r}: {', '.join(missing)}; "
            "run its migrations (2.x) there first"
        )
    for table, columns in COLUMNS.items():
        found = {column.name for column in connection.introspection.get_table_description(cursor, TABLE_PREFIX + table)}
        absent = [column for column in columns if column not in found]
        if absent:
            raise CeleryBeatImportRefused(
                f"{TABLE_PREFIX}{table} in database {using!r} has no column {', '.join(absent)}; "
                "run django-celery-beat's migrations (2.x) there first"
            )


def _select_sql(connection: BaseDatabaseWrapper) -> str:
    quote = connection.ops.quote_name
    columns = [f"t.{quote(column)}" for column in COLUMNS["periodictask"]]
    joins = []
    for kind, table in KINDS.items():
        alias = quote(f"j_{kind}")
        columns += [f"{alias}.{quote(column)} AS {quote(f'{kind}__{column}')}" for column in COLUMNS[table]]
        joins.append(
            f"LEFT JOIN {quote(TABLE_PREFIX + table)} {alias} ON {alias}.{quote('id')} = t.{quote(kind + '_id')}"
        )
    return f"SELECT {', '.join(columns)} FROM {quote(TABLE_PREFIX + 'periodictask')} t {' '.join(joins)}"


def _aware(value: datetime | str | None, connection: BaseDatabaseWrapper) -> datetime | None:
    # Backends without a time zone type (SQLite, MySQL) hand back naive
    # values in the connection's zone; SQLite may even hand back text.
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and value.tzinfo is None:
        value = value.replace(tzinfo=connection.timezone)
    return value


def _import_one(row: dict[str, Any], *, app: Celery, actor: audit.Actor, dry_run: bool) -> TaskOutcome:
    name = row["name"]
    if Schedule.objects.filter(tenant="", name=name).exists():
        return TaskOutcome(name=name, outcome=EXISTS)
    try:
        fields, notes = _schedule_fields(row)
    except _Refused as exc:
        return TaskOutcome(name=name, outcome=REFUSED, reason=str(exc))
    schedule = Schedule(**fields, origin=Schedule.Origin.IMPORT)
    try:
        operations.validate_schedule(schedule, app=app, scope=EVERY_TENANT)
    except ValidationError as exc:
        return TaskOutcome(name=name, outcome=REFUSED, reason=validation_message(exc))
    if not dry_run:
        operations.save_schedule(schedule, actor=actor, action="import")
    return TaskOutcome(name=name, outcome=IMPORTED, notes=tuple(notes), schedule=fields)


def _schedule_fields(row: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return a periodic task's Schedule fields and what it cannot keep.

    Raise ``_Refused`` when it has no faithful equivalent here.
    """
    kinds = [kind for kind in KINDS if row[f"{kind}_id"] is not None]
    if not kinds:
        raise _Refused("it has no schedule (none of crontab, interval, clocked or solar is set)")
    if len(kinds) > 1:
        raise _Refused(f"it has more than one schedule ({', '.join(kinds)}); django-celery-beat allows one")
    kind = kinds[0]
    if row[f"{kind}__id"] is None:
        raise _Refused(f"its {kind} schedule (id {row[f'{kind}_id']}) does not exist")
    one_off = bool(row["one_off"])
    enabled = bool(row["enabled"])
    notes = []
    if one_off and enabled and row["total_run_count"]:
        # django-celery-beat turns a one-off off on its next check after it ran.
        enabled = False
        notes.append("the one-off already ran in django-celery-beat, so it is imported disabled")
    timing = {"crontab": _crontab, "interval": _interval, "clocked": _clocked, "solar": _solar}[kind](row)
    if one_off and kind != "clocked":
        timing["max_runs"] = 1
    fields = {
        "name": row["name"],
        "task": row["task"],
        "args": _json(row["args"], "args", default=[]),
        "kwargs": _json(row["kwargs"], "kwargs", default={}),
        "queue": row["queue"] or "",
        "priority": row["priority"],
        # Its messages' options, as django-celery-beat sends them (``expire_seconds`` counts from the send, here from the slot).
        "expires": max(row["expire_seconds"], 1) if row["expire_seconds"] is not None else None,
        "headers": _json(row["headers"], "headers", default={}),
        "exchange": row["exchange"] or "",
        "routing_key": row["routing_key"] or "",
        "description": row["description"] or "",
        "enabled": enabled,
        "start_at": row["start_time"],
        # django-celery-beat turns a task off for good once `expires` passes.
        "end_at": row["expires"],
        "timezone": "UTC",
        **timing,
    }
    return fields, notes


def _crontab(row: dict[str, Any]) -> dict[str, Any]:
    # Empty fields mean "*", and spaces inside a field are ignored, as in
    # django-celery-beat's own display of the expression.
    minute, hour, day_of_month, month, day_of_week = (
        _WHITESPACE.sub("", row[f"crontab__{field}"] or "") or "*"
        for field in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    )
    if day_of_month != "*" and day_of_week != "*":
        raise _Refused(
            f"its crontab restricts both day of month ({day_of_month}) and day of week ({day_of_week}): "
            "Celery runs on days matching both, cron here on days matching either"
        )
    return {"cron": f"{minute} {hour} {day_of_month} {month} {day_of_week}", "timezone": row["crontab__timezone"] or ""}


def _interval(row: dict[str, Any]) -> dict[str, Any]:
    every, period = row["interval__every"], row["interval__period"]
    if period not in _PERIOD_MICROSECONDS:
        raise _Refused(f"its interval period {period!r} is not one of {', '.join(_PERIOD_MICROSECONDS)}")
    seconds, rest = divmod(every * _PERIOD_MICROSECONDS[period], 1_000_000)
    if rest or seconds < 1:
        raise _Refused(f"its interval (every {every} {period}) is not a positive whole number of seconds")
    return {"interval": seconds}


def _clocked(row: dict[str, Any]) -> dict[str, Any]:
    return {"run_at": row["clocked__clocked_time"]}


def _solar(row: dict[str, Any]) -> dict[str, Any]:
    raise _Refused(
        f"solar schedules ({row['solar__event']} at {_number(row['solar__latitude'])}, "
        f"{_number(row['solar__longitude'])}) "
        "have no equivalent here"
    )


def _number(value: Any) -> str:
    # SQLite hands decimals back as floats, PostgreSQL with trailing zeros.
    return format(Decimal(str(value)).normalize(), "f")


def _json(text: str | None, field: str, *, default: Any) -> Any:
    if not text:
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Refused(f"{field} is not valid JSON: {exc.msg} at position {exc.pos}") from None

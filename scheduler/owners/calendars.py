"""Calendars: the only writer of their rows, and the day filters schedules read, resolved as each process sees them.

A calendar's rules are checked and evaluated by ``scheduler.timing.calendars``
(pure); here names become calendars: a schedule's names are its tenant's
calendars, else every tenant's, and so are the calendars a calendar joins
or subtracts. Each process reads the calendars at most once every
``CACHE_SECONDS``, so an edit governs the next slots planned within that long.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from django.db.models import Q

from scheduler.exceptions import ScheduleInvalid
from scheduler.models import Calendar, Schedule
from scheduler.timing import calendars

#: How long a process keeps the calendars it read before it reads them again.
CACHE_SECONDS = 1.0

#: When the calendars were read, the rows by (tenant, name), and the day filters resolved from those rows.
_cached: tuple[float, dict[tuple[str, str], Calendar], dict[tuple[Any, ...], calendars.DayFilter]] | None = None


def _read(max_age: float) -> tuple[float, dict[tuple[str, str], Calendar], dict[tuple[Any, ...], calendars.DayFilter]]:
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] >= max_age:
        _cached = (now, {(row.tenant, row.name): row for row in Calendar.objects.all()}, {})
    return _cached


def _rows(max_age: float = CACHE_SECONDS) -> dict[tuple[str, str], Calendar]:
    """Every calendar, by (tenant, name); an every-tenant one by ("", name)."""
    return _read(max_age)[1]


def forget() -> None:
    """Read the calendars afresh next time (this process changed them)."""
    global _cached
    _cached = None


_Rows = Mapping[tuple[str, str], Calendar]


def resolve(tenant: str, name: str, *, max_age: float = CACHE_SECONDS) -> calendars.Calendar:
    """The calendar ``name`` with the calendars it joins and subtracts; ``ScheduleInvalid`` for a name or a loop.

    A schedule of ``tenant`` names its tenant's calendar, else every tenant's.
    """
    return _resolve(_rows(max_age), tenant, name, seen=())


def _resolve(rows: _Rows, tenant: str, name: str, *, seen: tuple[str, ...]) -> calendars.Calendar:
    if name in seen:
        raise ScheduleInvalid(f"Calendar {name!r} includes itself: {' -> '.join([*seen, name])}.")
    row = rows.get((tenant, name)) or rows.get(("", name))
    if row is None:
        raise ScheduleInvalid(f"No calendar {name!r}.")
    joins, subtracts = calendars.references(row.rules)
    deeper = (*seen, name)
    return calendars.Calendar(
        name=row.name,
        days=tuple(rule for rule in map(calendars.compile_rule, row.rules) if rule is not None),
        unions=tuple(_resolve(rows, tenant, other, seen=deeper) for other in joins),
        excepts=tuple(_resolve(rows, tenant, other, seen=deeper) for other in subtracts),
    )


def day_filter(tenant: str, *, exclude: list[str], only: str, max_age: float = CACHE_SECONDS) -> calendars.DayFilter:
    """The days a schedule of ``tenant`` with these calendars does not fire on.

    Resolved once per read of the calendars: the beat asks it for every due schedule that names one.
    """
    _, rows, filters = _read(max_age)
    key = (tenant, tuple(exclude), only)
    if key not in filters:
        filters[key] = calendars.DayFilter(
            exclude=tuple(_resolve(rows, tenant, name, seen=()) for name in exclude),
            only=_resolve(rows, tenant, only, seen=()) if only else None,
        )
    return filters[key]


def problems(row: Calendar) -> dict[str, list[str]]:
    """What is wrong with ``row`` as a calendar to keep, by field (empty: nothing)."""
    found: dict[str, list[str]] = {}
    if not row.name.strip() or ";" in row.name:
        found["name"] = ["Name the calendar (without ;)."]
    rule_problems = calendars.problems(row.rules)
    if rule_problems:
        found["rules"] = rule_problems
        return found
    saved = {key: other for key, other in _rows(max_age=0).items() if row.pk is None or other.pk != row.pk}
    try:  # resolved with this row as it would be saved
        _resolve({**saved, (row.tenant, row.name): row}, row.tenant, row.name, seen=())
    except ScheduleInvalid as error:
        found["rules"] = [str(error)]
    return found


def schedules_of(row: Calendar) -> list[Schedule]:
    """The schedules that name ``row`` (for a schedule, its tenant's own calendar of that name comes first)."""
    whose = Q() if row.every_tenant else Q(tenant=row.tenant)
    named = Schedule.objects.filter(whose).filter(Q(only_calendar=row.name) | Q(exclude_calendars__contains=row.name))
    return [
        schedule
        for schedule in named
        if (row.name in schedule.calendar_names or schedule.only_calendar == row.name)
        and not (
            row.every_tenant
            and Calendar.objects.filter(tenant=schedule.tenant, name=row.name).exclude(pk=row.pk).exists()
        )
    ]


def users(row: Calendar) -> list[str]:
    """The names of the schedules (and calendars) that name ``row``: it may not be deleted while any do."""
    whose = Q() if row.every_tenant else Q(tenant=row.tenant)
    named = [schedule.name for schedule in schedules_of(row)]
    others = Calendar.objects.filter(whose).exclude(pk=row.pk)
    for other in others:
        joins, subtracts = calendars.references(other.rules)
        if row.name in joins + subtracts:
            named.append(f"calendar {other.name}")
    return named


def save(row: Calendar) -> None:
    """Write ``row`` (already checked); processes see it within ``CACHE_SECONDS``, this one at once."""
    row.save()
    forget()


def delete(row: Calendar) -> None:
    Calendar.objects.filter(pk=row.pk).delete()
    forget()

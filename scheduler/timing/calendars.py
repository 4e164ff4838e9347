"""Calendars: sets of days, from rules, and which slots of a schedule they keep out. Pure: no database.

A calendar holds a day when any of its rules does, or a calendar it joins
does, and no calendar it subtracts does. Rules, as stored (JSON):

- ``{"dates": ["2026-12-24", "2026-12-27/2026-12-31"]}``: days, and ranges of days (both ends in);
- ``{"yearly": ["12-25", "01-01"]}``: the same month and day every year;
- ``{"weekdays": ["sat", "sun"]}``;
- ``{"holidays": {"country": "US", "subdivision": "NY"}}``: a country's (or a
  subdivision's) public holidays, or ``{"holidays": {"market": "NYSE"}}``: a
  financial market's closures, from the ``holidays`` package;
- ``{"cron": "* * 1 1,4,7,10 *"}``: the days a cron's day-of-month, month
  and day-of-week fields match (its time fields are not read; as in cron,
  a day of month and a day of week both given match either);
- ``{"union": "<calendar>"}`` and ``{"except": "<calendar>"}``: another calendar's days joined or subtracted.

A schedule may exclude calendars (a slot on one of their days does not
fire) or run only on one (a slot on a day it does not hold does not fire).
A slot's day is its date in the schedule's time zone, after the schedule's
DST policies placed it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import holidays
from croniter import croniter

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
KINDS = ("dates", "yearly", "weekdays", "holidays", "cron", "union", "except")
#: Rules one calendar may hold: each is read for every slot a schedule of it fires.
MAX_RULES = 50
#: Entries one list rule may hold.
MAX_ENTRIES = 1000

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_YEARLY = re.compile(r"^(\d{2})-(\d{2})$")


@dataclass(frozen=True)
class Calendar:
    """A calendar as its schedules read it: its own rules, and the calendars it joins and subtracts."""

    name: str
    days: tuple[Callable[[date], bool], ...] = ()
    unions: tuple[Calendar, ...] = ()
    excepts: tuple[Calendar, ...] = ()

    def contains(self, day: date) -> bool:
        held = any(rule(day) for rule in self.days) or any(other.contains(day) for other in self.unions)
        return held and not any(other.contains(day) for other in self.excepts)


@dataclass(frozen=True)
class DayFilter:
    """The days a schedule does not fire on: those of the calendars it excludes, and those its only calendar lacks."""

    exclude: tuple[Calendar, ...] = ()
    only: Calendar | None = None

    def excluded_by(self, day: date) -> str | None:
        """The name of the calendar that keeps ``day`` out, or ``None`` when the schedule fires on it."""
        if self.only is not None and not self.only.contains(day):
            return self.only.name
        return next((calendar.name for calendar in self.exclude if calendar.contains(day)), None)


# --- rules -----------------------------------------------------------------------------------


def problems(rules: Any) -> list[str]:
    """What is wrong with ``rules`` as a calendar's rules (empty: nothing); each names the rule."""
    if not isinstance(rules, list):
        return ['The rules are a list of objects, such as [{"weekdays": ["sat", "sun"]}].']
    if len(rules) > MAX_RULES:
        return [f"A calendar holds at most {MAX_RULES} rules, not {len(rules)}."]
    found: list[str] = []
    for number, rule in enumerate(rules, start=1):
        if not isinstance(rule, dict) or len(rule) != 1 or next(iter(rule)) not in KINDS:
            found.append(f'Rule {number}: one of {", ".join(KINDS)}, as {{"weekdays": ["sat"]}}; got {rule!r}.')
            continue
        kind, value = next(iter(rule.items()))
        problem = _CHECKS[kind](value)
        if problem:
            found.append(f"Rule {number} ({kind}): {problem}")
    return found


def compile_rule(rule: dict[str, Any]) -> Callable[[date], bool] | None:
    """The day test of a rule that holds days of its own (``None`` for ``union`` and ``except``)."""
    kind, value = next(iter(rule.items()))
    if kind == "dates":
        days, ranges = _dates(value)
        return lambda day: day in days or any(first <= day <= last for first, last in ranges)
    if kind == "yearly":
        yearly = frozenset((int(entry[:2]), int(entry[3:])) for entry in value)
        return lambda day: (day.month, day.day) in yearly
    if kind == "weekdays":
        numbers = frozenset(WEEKDAYS.index(entry.lower()) for entry in value)
        return lambda day: day.weekday() in numbers
    if kind == "holidays":
        return functools.partial(
            _is_holiday, value.get("country", ""), value.get("subdivision", ""), value.get("market", "")
        )
    if kind == "cron":
        day_fields = " ".join(value.split()[-3:])
        return lambda day: croniter.match(f"0 0 {day_fields}", datetime(day.year, day.month, day.day))
    return None


def references(rules: Iterable[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The names of the calendars ``rules`` join and subtract."""
    rules = list(rules)
    return (
        [rule["union"] for rule in rules if "union" in rule],
        [rule["except"] for rule in rules if "except" in rule],
    )


def _dates(value: list[str]) -> tuple[frozenset[date], list[tuple[date, date]]]:
    days, ranges = set(), []
    for entry in value:
        if "/" in entry:
            first, last = entry.split("/", 1)
            ranges.append((date.fromisoformat(first), date.fromisoformat(last)))
        else:
            days.add(date.fromisoformat(entry))
    return frozenset(days), ranges


@functools.lru_cache(maxsize=512)
def _holidays_of(country: str, subdivision: str, market: str, year: int) -> frozenset[date]:
    if market:
        return frozenset(holidays.financial_holidays(market, years=year))
    return frozenset(holidays.country_holidays(country, subdiv=subdivision or None, years=year))


def _is_holiday(country: str, subdivision: str, market: str, day: date) -> bool:
    return day in _holidays_of(country, subdivision, market, day.year)


def _list_of_strings(value: Any) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(entry, str) for entry in value):
        return "a non-empty list of strings."
    if len(value) > MAX_ENTRIES:
        return f"at most {MAX_ENTRIES} entries, not {len(value)}."
    return ""


def _check_dates(value: Any) -> str:
    problem = _list_of_strings(value)
    if problem:
        return problem
    for entry in value:
        ends = entry.split("/", 1)
        if not all(_DATE.match(end) for end in ends):
            return f"{entry!r} is not a date (2026-12-24) or a range of dates (2026-12-27/2026-12-31)."
        try:
            parsed = [date.fromisoformat(end) for end in ends]
        except ValueError:
            return f"{entry!r} is not a date of the calendar."
        if len(parsed) == 2 and parsed[0] > parsed[1]:
            return f"{entry!r} ends before it starts."
    return ""


def _check_yearly(value: Any) -> str:
    problem = _list_of_strings(value)
    if problem:
        return problem
    for entry in value:
        match = _YEARLY.match(entry)
        try:
            # 2024 is a leap year: 02-29 is a day some years have
            valid = match is not None and bool(date(2024, int(match[1]), int(match[2])))
        except ValueError:
            valid = False
        if not valid:
            return f"{entry!r} is not a month and day (12-25)."
    return ""


def _check_weekdays(value: Any) -> str:
    problem = _list_of_strings(value)
    if problem:
        return problem
    unknown = [entry for entry in value if entry.lower() not in WEEKDAYS]
    return f"{', '.join(map(repr, unknown))}: not one of {', '.join(WEEKDAYS)}." if unknown else ""


def _check_holidays(value: Any) -> str:
    if not isinstance(value, dict) or set(value) - {"country", "subdivision", "market"}:
        return 'an object with a "country" (and a "subdivision"), or a "market".'
    country, subdivision, market = value.get("country", ""), value.get("subdivision", ""), value.get("market", "")
    if not all(isinstance(part, str) for part in (country, subdivision, market)) or bool(country) == bool(market):
        return 'a "country" or a "market", not both.'
    if market:
        markets = holidays.list_supported_financial()
        return "" if market in markets else f"no market {market!r} (known: {', '.join(sorted(markets))})."
    countries = holidays.list_supported_countries()
    if country not in countries:
        return f"no country {country!r} (ISO 3166-1 codes such as US, DE, FR)."
    if subdivision and subdivision not in countries[country]:
        return f"no subdivision {subdivision!r} of {country} (known: {', '.join(countries[country])})."
    return ""


def _check_cron(value: Any) -> str:
    if not isinstance(value, str) or len(value.split()) != 5:
        return 'a cron expression of 5 fields ("* * * * SAT,SUN"); its last three say which days.'
    day_fields = " ".join(value.split()[-3:])
    if not croniter.is_valid(f"0 0 {day_fields}"):
        return f"{value!r} is not a valid cron expression."
    return ""


def _check_name(value: Any) -> str:
    return "" if isinstance(value, str) and value.strip() else "the name of another calendar."


_CHECKS: dict[str, Callable[[Any], str]] = {
    "dates": _check_dates,
    "yearly": _check_yearly,
    "weekdays": _check_weekdays,
    "holidays": _check_holidays,
    "cron": _check_cron,
    "union": _check_name,
    "except": _check_name,
}

"""Calendars as pure day sets, and the slots a schedule's calendars keep out (around a DST change)."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from scheduler import timing
from scheduler.timing import calendars, overdue

UTC = ZoneInfo("UTC")
NEW_YORK = ZoneInfo("America/New_York")


def calendar(name: str, *rules: dict, unions: tuple = (), excepts: tuple = ()) -> calendars.Calendar:
    assert calendars.problems(list(rules)) == []
    days = tuple(rule for rule in map(calendars.compile_rule, rules) if rule is not None)
    return calendars.Calendar(name, days, unions, excepts)


def test_rules__dates_ranges_yearly_weekdays_cron_and_holidays() -> None:
    assert calendar("d", {"dates": ["2026-12-24", "2026-12-27/2026-12-29"]}).contains(date(2026, 12, 28))
    assert not calendar("d", {"dates": ["2026-12-24"]}).contains(date(2026, 12, 25))
    assert calendar("y", {"yearly": ["12-25"]}).contains(date(2031, 12, 25))
    assert calendar("w", {"weekdays": ["Sat", "sun"]}).contains(date(2026, 11, 28))
    first_of_quarter = calendar("c", {"cron": "* * 1 1,4,7,10 *"})
    assert first_of_quarter.contains(date(2026, 10, 1)) and not first_of_quarter.contains(date(2026, 11, 1))
    # day of month and day of week restricted both: either matches, as in cron
    either = calendar("c", {"cron": "* * 1-7 * MON"})
    assert either.contains(date(2026, 12, 3)) and either.contains(date(2026, 12, 14))
    us = calendar("us", {"holidays": {"country": "US"}})
    assert us.contains(date(2026, 11, 26)) and not us.contains(date(2026, 11, 27))
    nyse = calendar("nyse", {"holidays": {"market": "NYSE"}})
    assert nyse.contains(date(2026, 4, 3)) and not us.contains(date(2026, 4, 3))  # Good Friday: the market only


def test_union_and_difference() -> None:
    weekend = calendar("weekend", {"weekdays": ["sat", "sun"]})
    holidays = calendar("holidays", {"holidays": {"country": "US"}})
    closed = calendar("closed", unions=(weekend, holidays))
    open_saturday = calendar(
        "closed but one saturday", unions=(closed,), excepts=(calendar("x", {"dates": ["2026-11-28"]}),)
    )
    assert closed.contains(date(2026, 11, 26)) and closed.contains(date(2026, 11, 29))
    assert not open_saturday.contains(date(2026, 11, 28)) and open_saturday.contains(date(2026, 11, 29))


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"weekdays": ["sat"]}, "The rules are a list"),
        ([{"weekday": ["sat"]}], "Rule 1: one of dates"),
        ([{"dates": ["2026-02-30"]}], "is not a date of the calendar"),
        ([{"dates": ["2026-12-31/2026-12-01"]}], "ends before it starts"),
        ([{"yearly": ["13-01"]}], "is not a month and day"),
        ([{"weekdays": ["someday"]}], "not one of mon"),
        ([{"holidays": {"country": "XX"}}], "no country 'XX'"),
        ([{"holidays": {"country": "US", "subdivision": "ZZ"}}], "no subdivision 'ZZ' of US"),
        ([{"holidays": {"market": "NOPE"}}], "no market 'NOPE'"),
        ([{"holidays": {"country": "US", "market": "NYSE"}}], 'a "country" or a "market", not both'),
        ([{"cron": "* * 32 * *"}], "is not a valid cron expression"),
        ([{"union": ""}], "the name of another calendar"),
    ],
)
def test_problems__each_names_its_rule(rules: object, message: str) -> None:
    found = calendars.problems(rules)
    assert found and message in found[0], found


def test_an_hourly_schedule_excluding_a_holiday_on_a_dst_change__nothing_that_day_every_hour_the_days_around() -> None:
    # Given an hourly cron in New York, where 2026-11-01 is 25 hours long (clocks go back), and a holiday that day
    holiday = calendar("company holiday", {"dates": ["2026-11-01"]})
    hourly = timing.Timing(cron="0 * * * *", timezone="America/New_York", days=calendars.DayFilter(exclude=(holiday,)))

    # When its slots from 2026-10-31 00:00 to 2026-11-03 00:00 (local) are listed
    since = datetime(2026, 10, 31, tzinfo=NEW_YORK) - timedelta(microseconds=1)
    until = datetime(2026, 11, 3, tzinfo=NEW_YORK) - timedelta(microseconds=1)
    slots = timing.slots_between(hourly, since=since, until=until)

    # Then none falls on the holiday, and the days before and after have every hour
    local_days = [slot.astimezone(NEW_YORK).date() for slot in slots]
    assert date(2026, 11, 1) not in local_days
    assert local_days.count(date(2026, 10, 31)) == 24 and local_days.count(date(2026, 11, 2)) == 24
    # and the schedule without the calendar fires every hour of the holiday, all 25 of them
    plain = timing.slots_between(timing.Timing(cron="0 * * * *", timezone="America/New_York"), since=since, until=until)
    assert [slot.astimezone(NEW_YORK).date() for slot in plain].count(date(2026, 11, 1)) == 25


def test_only_on_business_days__a_month_has_its_business_days_and_the_preview_names_what_kept_each_out() -> None:
    # Given business days: not weekends, not US holidays
    closed = calendar(
        "closed",
        unions=(calendar("weekend", {"weekdays": ["sat", "sun"]}), calendar("us", {"holidays": {"country": "US"}})),
    )
    business = calendar("business days", {"cron": "* * * * *"}, excepts=(closed,))
    daily = timing.Timing(cron="0 9 * * *", timezone="America/New_York", days=calendars.DayFilter(only=business))

    # When November 2026's slots are listed
    since = datetime(2026, 11, 1, tzinfo=NEW_YORK)
    slots = timing.slots_between(daily, since=since, until=datetime(2026, 12, 1, tzinfo=NEW_YORK))

    # Then they are its business days: its weekdays, less Veterans Day and Thanksgiving
    weekdays = [since.date() + timedelta(days=n) for n in range(30)]
    expected = [day for day in weekdays if day.weekday() < 5 and day not in (date(2026, 11, 11), date(2026, 11, 26))]
    assert [slot.astimezone(NEW_YORK).date() for slot in slots] == expected
    # and the preview lists every slot, each kept out with the calendar's name
    preview = timing.excluded_slots(daily, after=since, count=7)
    assert [(slot.astimezone(NEW_YORK).day, why) for slot, why in preview] == [
        (1, "business days"),
        (2, None),
        (3, None),
        (4, None),
        (5, None),
        (6, None),
        (7, "business days"),
    ]


def test_a_calendar_that_keeps_every_day_out_ends_the_schedule_instead_of_searching_forever() -> None:
    never = timing.Timing(cron="0 9 * * *", days=calendars.DayFilter(exclude=(calendar("all", {"cron": "* * * * *"}),)))
    assert timing.next_slot(never, after=datetime(2026, 1, 1, tzinfo=UTC)) is None


def test_cadence__counts_the_gaps_a_calendar_makes_so_a_weekend_is_not_overdue() -> None:
    # Given a 09:00 schedule on weekdays only
    weekdays_only = calendars.DayFilter(exclude=(calendar("weekend", {"weekdays": ["sat", "sun"]}),))
    daily = timing.Timing(cron="0 9 * * *", timezone="America/New_York", days=weekdays_only)

    # Then its window is twice the longest weekend's gap, Friday 09:00 to Monday 09:00 over the weekend
    # clocks go back (73 hours), not twice a day (25 hours at most)
    assert overdue.cadence(daily, since=datetime(2026, 11, 2, tzinfo=NEW_YORK)) == 2 * 73 * 3600
    assert overdue.cadence(timing.Timing(cron="0 9 * * *", timezone="America/New_York")) == 2 * 25 * 3600

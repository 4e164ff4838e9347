"""Properties of scheduler.timing over random expressions, zones and instants."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.timing import Timing, next_slot, slots_between

UTC = timezone.utc
TICK = timedelta(microseconds=1)
ZONES = ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC")
FIRST = datetime(2020, 1, 1, tzinfo=UTC)
LAST = datetime(2030, 12, 31, tzinfo=UTC)

# Modest counts keep the file to a few seconds; database=None keeps runs pure.
PROPERTY = settings(max_examples=150, deadline=None, database=None)


# --- oracles --------------------------------------------------------------------


@functools.cache
def transitions(zone: str) -> tuple[datetime, ...]:
    """Return the instants in 2020-2030 at which `zone` changes its UTC offset."""
    tz = ZoneInfo(zone)
    found = []
    step = timedelta(hours=12)
    moment = FIRST - step
    offset = moment.astimezone(tz).utcoffset()
    while moment < LAST:
        later = moment + step
        later_offset = later.astimezone(tz).utcoffset()
        if later_offset != offset:
            low, high = moment, later
            while high - low > timedelta(seconds=1):
                middle = low + (high - low) / 2
                if middle.astimezone(tz).utcoffset() == offset:
                    low = middle
                else:
                    high = middle
            found.append(high.replace(microsecond=0))
        moment, offset = later, later_offset
    return tuple(found)


@functools.cache
def expanded(expr: str) -> list[list[int | str]]:
    return croniter.expand(expr, second_at_beginning=len(expr.split()) == 6)[0]


def matches(expr: str, wall: datetime) -> bool:
    """Say whether a naive wall time matches expr (the syntax generated below)."""
    fields = expanded(expr)
    minute, hour, dom, month, dow = fields[:5]
    second = fields[5] if len(fields) == 6 else [0]

    def has(allowed: list[int | str], value: int) -> bool:
        return allowed == ["*"] or value in allowed

    cron_dow = wall.isoweekday() % 7  # cron counts Sunday as 0
    if dom != ["*"] and dow != ["*"]:
        day = has(dom, wall.day) or has(dow, cron_dow)  # cron's OR rule
    else:
        day = has(dom, wall.day) and has(dow, cron_dow)
    return (
        day
        and has(month, wall.month)
        and has(hour, wall.hour)
        and has(minute, wall.minute)
        and has(second, wall.second)
        and wall.microsecond == 0
    )


def every_hour(expr: str) -> bool:
    return expanded(expr)[1] == ["*"]


def ambiguous(wall: datetime, tz: ZoneInfo) -> bool:
    first, second = (wall.replace(tzinfo=tz, fold=fold).utcoffset() for fold in (0, 1))
    return first != second


def is_transition(moment: datetime, tz: ZoneInfo) -> bool:
    return (moment - TICK).astimezone(tz).utcoffset() != moment.astimezone(tz).utcoffset()


# --- strategies -----------------------------------------------------------------


def _list_of(low: int, high: int) -> st.SearchStrategy[str]:
    return st.lists(st.integers(low, high), min_size=2, max_size=3, unique=True).map(
        lambda values: ",".join(str(value) for value in sorted(values))
    )


def _range_of(low: int, high: int) -> st.SearchStrategy[str]:
    return st.tuples(st.integers(low, high - 1), st.integers(1, high - low)).map(
        lambda pair: f"{pair[0]}-{min(pair[0] + pair[1], high)}"
    )


MINUTES = st.one_of(
    st.sampled_from(["*", "0", "30", "*/5", "*/7", "*/15", "*/30", "0,45", "10-40/10"]),
    st.integers(0, 59).map(str),
    _list_of(0, 59),
    _range_of(0, 59),
)
EVERY_HOUR = st.sampled_from(["*", "*/1", "0-23"])
#: the local hours the zones below change their clocks in
DST_HOURS = st.sampled_from(["1", "2", "3", "1-3", "1,2", "2,3", "0-4/2"])
HOURS = st.one_of(
    EVERY_HOUR,
    DST_HOURS,
    st.sampled_from(["*/2", "*/3", "*/6", "9-17"]),
    st.integers(0, 23).map(str),
    _list_of(0, 23),
    _range_of(0, 23),
)
# Mostly "*", and otherwise often matching the Sundays in March, April,
# October and November that the zones below change their clocks on.
DAYS = st.sampled_from(["*"] * 6 + ["1", "15", "1-15", "*/2", "8-14", "28"])
MONTHS = st.sampled_from(["*"] * 6 + ["3,10", "4,10,11", "3,4,10,11", "*/3", "1", "6-9"])
WEEKDAYS = st.sampled_from(["*"] * 6 + ["0", "1-5", "0,6", "0-3", "5", "sat,sun"])
SECONDS = st.sampled_from(["0", "5", "*/10", "*/15", "0,30"])
GAPS = st.sampled_from(["shift", "skip"])
FOLDS = st.sampled_from(["first", "last", "both"])
DST_ZONES = ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe")


def crons(*, six: bool | None, hours: st.SearchStrategy[str], anyday: bool) -> st.SearchStrategy[str]:
    """Return expressions in 5 fields, 6 (seconds first), or either when six is None."""
    star = st.just("*")
    days = (star, star, star) if anyday else (DAYS, MONTHS, WEEKDAYS)
    five = st.tuples(MINUTES, hours, *days).map(" ".join)
    with_seconds = st.tuples(SECONDS, MINUTES, hours, *days).map(" ".join)
    if six is None:
        pick = st.sampled_from([five, five, with_seconds])
        return pick.flatmap(lambda chosen: chosen)
    return with_seconds if six else five


@st.composite
def cron_cases(
    draw: st.DrawFn,
    *,
    six: bool | None = None,
    hourly: bool = False,
    gaps: st.SearchStrategy[str] = GAPS,
) -> tuple[Timing, datetime, datetime]:
    """Draw a cron timing and a window, two in three starting just before a DST change."""
    if draw(st.sampled_from([True, True, False])):
        zone = draw(st.sampled_from(DST_ZONES))
        transition = draw(st.sampled_from(transitions(zone)))
        since = transition - timedelta(seconds=draw(st.integers(0, 5 * 3600)))
        hours = EVERY_HOUR if hourly else st.one_of(DST_HOURS, EVERY_HOUR, HOURS)
        expr = draw(crons(six=six, hours=hours, anyday=draw(st.booleans())))
    else:
        zone = draw(st.sampled_from(ZONES))
        seconds = draw(st.integers(0, int((LAST - FIRST).total_seconds())))
        micros = draw(st.sampled_from([0, 1, 500_000]))
        since = FIRST + timedelta(seconds=seconds, microseconds=micros)
        expr = draw(crons(six=six, hours=EVERY_HOUR if hourly else HOURS, anyday=False))
    timing = Timing(cron=expr, timezone=zone, dst_gap=draw(gaps), dst_fold=draw(FOLDS))
    minutes = draw(st.sampled_from([360, 720, 4320]) | st.integers(1, 4320))
    return timing, since, since + timedelta(minutes=minutes)


@st.composite
def instants(draw: st.DrawFn) -> datetime:
    """Draw an instant in 2020-2030 to the microsecond."""
    seconds = draw(st.integers(0, int((LAST - FIRST).total_seconds())))
    return FIRST + timedelta(seconds=seconds, microseconds=draw(st.integers(0, 999_999)))


# --- cron properties ------------------------------------------------------------


@PROPERTY
@given(cron_cases())
def test_slots_between__cron_slots_strictly_increase_within_bounds(
    case: tuple[Timing, datetime, datetime],
) -> None:
    timing, since, until = case

    slots = slots_between(timing, since=since, until=until, limit=200)

    assert all(earlier < later for earlier, later in zip(slots, slots[1:]))
    assert all(since < slot <= until and slot.tzinfo is UTC for slot in slots)


@PROPERTY
@given(cron_cases(gaps=st.just("skip")))
def test_slots_between__with_skip_every_slot_matches_expression_in_local_time(
    case: tuple[Timing, datetime, datetime],
) -> None:
    timing, since, until = case
    assert timing.cron is not None
    tz = ZoneInfo(timing.timezone)

    slots = slots_between(timing, since=since, until=until, limit=200)

    for slot in slots:
        assert matches(timing.cron, slot.astimezone(tz).replace(tzinfo=None)), slot


@PROPERTY
@given(cron_cases())
def test_slots_between__cron_slots_honour_dst_policies(
    case: tuple[Timing, datetime, datetime],
) -> None:
    timing, since, until = case
    assert timing.cron is not None
    tz = ZoneInfo(timing.timezone)
    hourly = every_hour(timing.cron)

    slots = slots_between(timing, since=since, until=until, limit=200)

    for slot in slots:
        local = slot.astimezone(tz)
        wall = local.replace(tzinfo=None)
        if not matches(timing.cron, wall):
            # Only a gap time moved to the transition may fire off-pattern.
            assert timing.dst_gap == "shift" and not hourly, slot
            assert is_transition(slot, tz), slot
        elif ambiguous(wall, tz) and not hourly and timing.dst_fold != "both":
            assert local.fold == (0 if timing.dst_fold == "first" else 1), slot


def brute_force(timing: Timing, *, since: datetime, until: datetime) -> list[datetime]:
    """Return the real minutes in (since, until] whose local wall time matches."""
    assert timing.cron is not None
    tz = ZoneInfo(timing.timezone)
    minute = since.replace(second=0, microsecond=0) + timedelta(minutes=1)
    found = []
    while minute <= until:
        if matches(timing.cron, minute.astimezone(tz).replace(tzinfo=None)):
            found.append(minute)
        minute += timedelta(minutes=1)
    return found


@PROPERTY
@given(cron_cases(six=False))
def test_slots_between__skip_and_both_give_every_matching_real_minute(
    case: tuple[Timing, datetime, datetime],
) -> None:
    # Given skip + both: every real minute whose wall time matches fires, once
    timing, since, _ = case
    assert timing.cron is not None
    timing = Timing(cron=timing.cron, timezone=timing.timezone, dst_gap="skip", dst_fold="both")
    until = since + timedelta(hours=6)

    expected = brute_force(timing, since=since, until=until)
    assert slots_between(timing, since=since, until=until) == expected


@PROPERTY
@given(cron_cases(six=False, hourly=True))
def test_slots_between__every_hour_expression_ignores_dst_policies(
    case: tuple[Timing, datetime, datetime],
) -> None:
    # Given an every-hour expression, whatever dst_gap and dst_fold say, it
    # fires at every real minute whose wall time matches (cronie's rule)
    timing, since, _ = case
    until = since + timedelta(hours=6)

    expected = brute_force(timing, since=since, until=until)
    assert slots_between(timing, since=since, until=until) == expected


@PROPERTY
@given(cron_cases())
def test_next_slot__cron_agrees_with_slots_between(
    case: tuple[Timing, datetime, datetime],
) -> None:
    timing, since, until = case
    limit = 30

    slots = slots_between(timing, since=since, until=until, limit=limit)

    following = next_slot(timing, after=since)
    if slots:
        assert following == slots[0]
    else:
        assert following is None or following > until
    for earlier, later in zip(slots, slots[1:]):
        assert next_slot(timing, after=earlier) == later
    if slots and len(slots) < limit:
        beyond = next_slot(timing, after=slots[-1])
        assert beyond is None or beyond > until


# --- interval properties ----------------------------------------------------------


INTERVALS = st.one_of(st.integers(1, 120), st.sampled_from([3600, 86_400, 7 * 86_400]), st.integers(1, 10**6))


@PROPERTY
@given(
    INTERVALS,
    st.sampled_from(ZONES),
    st.none() | instants(),
    instants(),
    st.integers(1, 10**6),
)
def test_slots_between__interval_slots_lie_exactly_on_anchor_grid(
    interval: int, zone: str, start_at: datetime | None, since: datetime, window: int
) -> None:
    timing = Timing(interval=interval, timezone=zone, start_at=start_at)
    until = since + timedelta(seconds=window)
    anchor = start_at or datetime(1970, 1, 1, tzinfo=UTC)
    step = timedelta(seconds=interval)

    slots = slots_between(timing, since=since, until=until, limit=100)

    # Every slot is on the grid, one step after the previous one, ...
    assert all((slot - anchor) % step == timedelta(0) for slot in slots)
    assert all(later - earlier == step for earlier, later in zip(slots, slots[1:]))
    # ... the first is the first grid point after since, and none is before start_at.
    first = anchor + max(0, (since - anchor) // step + 1) * step
    assert (slots[:1] == [first]) if first <= until else slots == []
    assert next_slot(timing, after=since) == first

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
    return wall.replace(tzinfo=tz, fold=0).utcoffset() != wall.replace(tzinfo=tz, fold=1).utcoffset()


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
    st.sampled_from(["*", "0", "30", "*/5", "*/7", "*/15", "*/30"]),
    st.integers(0, 59).map(str),
    _list_of(0, 59),
    _range_of(0, 59),
)
EVERY_HOUR = st.sampled_from(["*", "*/1", "0-23"])
HOURS = st.one_of(
    EVERY_HOUR,
    # The hours the zones above change their clocks in, to hit gaps and folds.
    st.sampled_from(["1", "2", "3", "1-3", "2,3", "0-4/2", "*/2"]),
    st.integers(0, 23).map(str),
    _list_of(0, 23),
    _range_of(0, 23),
)
DAYS = st.sampled_from(["*", "*", "*", "*", "1", "15", "28", "1-15", "*/2"])
MONTHS = st.sampled_from(["*", "*", "*", "*", "3", "10", "3,10", "4,10,11", "*/3"])
WEEKDAYS = st.sampled_from(["*", "*", "*", "*", "0", "1-5", "0,6", "5"])
SECONDS = st.sampled_from(["0", "5", "*/10", "*/15", "0,30"])

FIVE_FIELDS = st.tuples(MINUTES, HOURS, DAYS, MONTHS, WEEKDAYS).map(" ".join)
FIVE_FIELDS_EVERY_HOUR = st.tuples(MINUTES, EVERY_HOUR, DAYS, MONTHS, WEEKDAYS).map(" ".join)
SIX_FIELDS = st.tuples(SECONDS, MINUTES, HOURS, DAYS, MONTHS, WEEKDAYS).map(" ".join)
CRONS = st.one_of(FIVE_FIELDS, FIVE_FIELDS, SIX_FIELDS)
GAPS = st.sampled_from(["shift", "skip"])
FOLDS = st.sampled_from(["first", "last", "both"])


@st.composite
def moments(draw: st.DrawFn, zone: str) -> datetime:
    """Draw an instant in 2020-2030, mostly within hours of one of zone's transitions."""
    near = transitions(zone)
    if near and draw(st.integers(0, 3)):
        base = draw(st.sampled_from(near))
        return base + timedelta(seconds=draw(st.integers(-5 * 3600, 2 * 3600)))
    seconds = draw(st.integers(0, int((LAST - FIRST).total_seconds())))
    return FIRST + timedelta(seconds=seconds, microseconds=draw(st.sampled_from([0, 0, 1, 500_000])))


@st.composite
def cron_cases(
    draw: st.DrawFn, crons: st.SearchStrategy[str] = CRONS, gaps: st.SearchStrategy[str] = GAPS
) -> tuple[Timing, datetime, datetime]:
    zone = draw(st.sampled_from(ZONES))
    timing = Timing(cron=draw(crons), timezone=zone, dst_gap=draw(gaps), dst_fold=draw(FOLDS))
    since = draw(moments(zone))
    until = since + timedelta(minutes=draw(st.integers(1, 12 * 60) | st.integers(1, 3 * 24 * 60)))
    return timing, since, until


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
def test_slots_between__cron_slots_honour_dst_policies(case: tuple[Timing, datetime, datetime]) -> None:
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
@given(cron_cases(crons=FIVE_FIELDS))
def test_slots_between__skip_and_both_give_every_matching_real_minute(
    case: tuple[Timing, datetime, datetime],
) -> None:
    # Given skip + both: every real minute whose wall time matches fires, once
    timing, since, _ = case
    assert timing.cron is not None
    timing = Timing(cron=timing.cron, timezone=timing.timezone, dst_gap="skip", dst_fold="both")
    until = since + timedelta(hours=6)

    assert slots_between(timing, since=since, until=until) == brute_force(timing, since=since, until=until)


@PROPERTY
@given(cron_cases(crons=FIVE_FIELDS_EVERY_HOUR))
def test_slots_between__every_hour_expression_ignores_dst_policies(
    case: tuple[Timing, datetime, datetime],
) -> None:
    # Given an every-hour expression, whatever dst_gap and dst_fold say, it
    # fires at every real minute whose wall time matches (cronie's rule)
    timing, since, _ = case
    until = since + timedelta(hours=6)

    assert slots_between(timing, since=since, until=until) == brute_force(timing, since=since, until=until)


@PROPERTY
@given(cron_cases())
def test_next_slot__cron_agrees_with_slots_between(case: tuple[Timing, datetime, datetime]) -> None:
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
    st.none() | moments("Europe/Berlin"),
    moments("Europe/Berlin"),
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

"""Schedule slot maths: when a cron, interval or one-off timing fires.

Pure functions of their arguments: no ORM, no Celery, no clock reads. Every
slot is an aware UTC datetime, so every process computes the same instants.

Cron expressions are evaluated in the wall-clock time of the schedule's
zone, and each matching wall time is then mapped to real instants:

- A wall time that does not exist (spring-forward gap) runs at the first
  instant after the gap, the transition itself, with ``dst_gap="shift"``
  (Europe/Berlin 2025-03-30 02:30 runs at 03:00 CEST, 01:00Z), or not at all
  with ``dst_gap="skip"``.
- A wall time that occurs twice (fall-back fold) runs at its earlier instant
  with ``dst_fold="first"``, at its later one with ``"last"``, or at both
  with ``"both"``.
- Exception: when the hour field matches every hour (``0 * * * *``,
  ``*/15 * * * *``, ``*/5 * * * * *``), the job means "every hour" and runs
  every real hour. Nonexistent wall times are skipped, because the real
  hours are already covered, and ambiguous ones run at both instants,
  whatever ``dst_gap`` and ``dst_fold`` say. This is cronie's rule, and it is
  the only way an hourly job keeps running every hour across fall-back.

Instants that coincide (several gap times shifted to the same transition,
or a shifted time equal to a real slot) collapse into one, and slots are
always strictly increasing in real time.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import heapq
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, time, timedelta
from datetime import timezone as dt_timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import cron_descriptor
from croniter import CroniterBadDateError, CroniterError, croniter

from scheduler.exceptions import ScheduleInvalid
from scheduler.timing.calendars import DayFilter

__all__ = ["Timing", "count_slots", "longest_gap", "next_slot", "slots_between", "validate_cron", "validate_timezone"]

UTC = dt_timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)
_Y2K = datetime(2000, 1, 1, tzinfo=UTC)
_TICK = timedelta(microseconds=1)  # the resolution of datetime
#: Excluded days in a row after which a schedule's calendars are taken to keep out every day to come.
CALENDAR_DAYS_SKIPPED = 3660
#: no zone's UTC offset comes close to a day, so a wall time more than a day
#: past a bound cannot map to an instant at or before it
_OFFSET_BOUND = timedelta(days=1)
#: give up when a cron schedule has no slot for this long, as croniter does
#: (its max_years_between_matches is 50): walking year by year through wall
#: times that are all skipped (02:30 on the last Sunday of March in Berlin,
#: with dst_gap="skip") would otherwise run until year 9999
_MAX_SILENCE = timedelta(days=50 * 366)

DST_GAP_POLICIES = ("shift", "skip")
DST_FOLD_POLICIES = ("first", "last", "both")

#: Cron expressions one schedule may carry (``;``-separated), so a pass over its slots stays cheap.
MAX_CRON_SPECS = 8
#: field names in croniter's expanded order (seconds last even when written first)
_FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week", "second")
#: the same fields in the order they are written in a 6-field expression
_SECONDS_FIRST_ORDER = (5, 0, 1, 2, 3, 4)
_FIELD_RANGES = ("0-59", "0-23", "1-31", "1-12", "0-7", "0-59")
_HOUR = 1
# croniter.croniter splits on ASCII whitespace only; count fields the same way.
_FIELD_RE = re.compile(r"\S+", re.ASCII)
# croniter's own syntax for hashed (H) and random (R) values.
_HASH_RE = re.compile(r"^h(?:\((\d+)-(\d+)\))?(?:/(\d+))?$", re.ASCII | re.IGNORECASE)
#: The values an ``H`` field spreads over, by field (days of the month: those every month has).
_HASH_RANGES = {
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 28),
    "month": (1, 12),
    "day-of-week": (0, 6),
    "second": (0, 59),
}
_RANDOM_RE = re.compile(r"^r(\(\d+-\d+\))?(/\d+)?$", re.ASCII | re.IGNORECASE)
_ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


@dataclass(frozen=True)
class Timing:
    """When a schedule fires; exactly one of cron, interval and run_at is set.

    Construction validates every field and raises ScheduleInvalid with a
    message that names the problem.
    """

    #: 5 fields (min hour dom mon dow), or 6 with seconds first (sec min hour dom mon dow)
    cron: str | None = None
    #: seconds, > 0; slots are start_at (or the Unix epoch) + k * interval
    interval: int | None = None
    #: the one slot of a one-off, aware
    run_at: datetime | None = None
    #: IANA name; cron wall times are read in this zone
    timezone: str = "UTC"
    #: aware; no slot before it (inclusive)
    start_at: datetime | None = None
    #: aware; no slot after it (inclusive)
    end_at: datetime | None = None
    #: total runs allowed, earlier ones included
    max_runs: int | None = None
    #: what a nonexistent wall time does: one of DST_GAP_POLICIES
    dst_gap: str = "shift"
    #: what an ambiguous wall time does: one of DST_FOLD_POLICIES
    dst_fold: str = "first"
    #: what a cron's ``H`` fields are hashed from (a schedule's tenant and name): the same slots everywhere
    hash_key: str = ""
    #: the days it does not fire on (its calendars); a slot's day is its date in ``timezone``
    days: DayFilter | None = None

    def __post_init__(self) -> None:
        given = (("cron", self.cron), ("interval", self.interval), ("run_at", self.run_at))
        kinds = [name for name, value in given if value is not None]
        if len(kinds) != 1:
            got = " and ".join(kinds) if kinds else "none"
            raise ScheduleInvalid(f"Exactly one of cron, interval or run_at must be set, got {got}")
        if self.cron is not None:
            validate_cron(self.cron, hash_key=self.hash_key)
        if self.interval is not None and (not _is_count(self.interval) or self.interval == 0):
            raise ScheduleInvalid(f"Interval must be a positive whole number of seconds, got {self.interval!r}")
        validate_timezone(self.timezone)
        for name in ("run_at", "start_at", "end_at"):
            value = getattr(self, name)
            if value is not None and not _is_aware(value):
                raise ScheduleInvalid(f"{name} must be a timezone-aware datetime, got {value!r}")
        if self.start_at is not None and self.end_at is not None and self.start_at > self.end_at:
            raise ScheduleInvalid(
                f"start_at ({self.start_at.isoformat()}) must not be after end_at ({self.end_at.isoformat()})"
            )
        if self.max_runs is not None and not _is_count(self.max_runs):
            raise ScheduleInvalid(f"max_runs must be a whole number >= 0, got {self.max_runs!r}")
        if self.dst_gap not in DST_GAP_POLICIES:
            raise ScheduleInvalid(f"dst_gap must be 'shift' or 'skip', got {self.dst_gap!r}")
        if self.dst_fold not in DST_FOLD_POLICIES:
            raise ScheduleInvalid(f"dst_fold must be 'first', 'last' or 'both', got {self.dst_fold!r}")


def describe(timing: Timing) -> str:
    """Return the timing in words: "Every 5 minutes (UTC)", "every 30 seconds", "once at ..."."""
    if timing.run_at is not None:
        return f"once at {timing.run_at.astimezone(ZoneInfo(timing.timezone)):%Y-%m-%d %H:%M:%S %Z}"
    if timing.interval is not None:
        return f"every {timing.interval} second{'s' if timing.interval != 1 else ''}"
    assert timing.cron is not None
    options = cron_descriptor.Options()
    options.use_24hour_time_format = True
    described = []
    for spec in cron_specs(timing.cron):
        expr = resolved_cron(spec, hash_key=timing.hash_key)
        try:
            described.append(cron_descriptor.get_description(expr, options))
        except Exception:  # noqa: BLE001 -- a description is cosmetic; the expression itself is valid
            described.append(expr)
    return f"{'; and '.join(described)} ({timing.timezone})"


def is_hashed(expr: str | None) -> bool:
    """Whether the cron expression has ``H`` fields (its slots then depend on its ``hash_key``)."""
    specs = (expr or "").split(";")
    return any(_HASH_RE.match(part) for spec in specs for field in _FIELD_RE.findall(spec) for part in field.split(","))


def resolved_cron(expr: str, *, hash_key: str = "") -> str:
    """The expression with each ``H`` field replaced by the values it stands for under ``hash_key``."""
    if not is_hashed(expr):
        return expr
    return "; ".join(_parse_cron(spec, hash_key).text for spec in cron_specs(expr))


def validate_cron(expr: str, *, hash_key: str = "") -> None:
    """Raise ScheduleInvalid, saying what is wrong, unless expr is a usable cron expression.

    An expression that is well formed but never matches (``0 0 30 2 *``) is
    accepted; next_slot returns None for it (``cron_dates_problem`` says
    so, for a form). ``H`` fields are hashed from ``hash_key``; any key
    shows whether the expression is well formed.
    """
    if not isinstance(expr, str) or not expr.strip():
        raise ScheduleInvalid("Cron expression is required")
    specs = cron_specs(expr)
    if len(specs) > MAX_CRON_SPECS:
        raise ScheduleInvalid(f"At most {MAX_CRON_SPECS} cron expressions, separated by ';'; got {len(specs)}")
    for spec in specs:
        _parse_cron(spec, hash_key)


def cron_dates_problem(expr: str, *, hash_key: str = "") -> str:
    """Say which expression of a valid ``expr`` matches no date at all (``0 0 30 2 *``); "" when each one does.

    Such a schedule would be saved and never fire. Asked of the expression
    alone, in UTC from 2000 on: a cron without a year repeats within 28
    years, so no slot within croniter's 50 means none ever.
    """
    for spec in cron_specs(expr):
        if next_slot(Timing(cron=spec, timezone="UTC", hash_key=hash_key), after=_Y2K) is None:
            return f"{spec!r} matches no date (no such day in those months): it would never fire."
    return ""


def cron_specs(expr: str) -> list[str]:
    """The cron expressions of ``expr``: one, or several separated by ``;`` (their slots are merged)."""
    specs = [spec.strip() for spec in expr.split(";")]
    if len(specs) > 1 and not all(specs):
        raise ScheduleInvalid(f"Invalid cron expression {expr!r}: an empty expression between ';'")
    return specs


def validate_timezone(name: str) -> None:
    """Raise ScheduleInvalid unless name is a known IANA time zone."""
    if not isinstance(name, str) or not name.strip():
        raise ScheduleInvalid("Timezone is required")
    if name == "localtime":
        # A symlink to the host's zone, not an IANA name: two hosts would
        # disagree on when the schedule fires.
        raise ScheduleInvalid("Unknown timezone 'localtime'; use an IANA name such as 'Europe/Berlin'")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # ValueError covers keys that are not relative paths ('/etc/x', '../x'),
        # OSError a folder of the zone files ('Europe') or a name too long for a file.
        raise ScheduleInvalid(f"Unknown timezone {name!r}") from exc


@functools.lru_cache(maxsize=512)
def zone_is_valid(timezone: str, dst_gap: str, dst_fold: str) -> bool:
    """Whether a timing in ``timezone`` with these DST policies is valid (schedules share a handful: cached).

    A zone valid when its schedule was saved can vanish in a tzdata upgrade.
    """
    try:
        Timing(interval=1, timezone=timezone, dst_gap=dst_gap, dst_fold=dst_fold)
    except ScheduleInvalid:
        return False
    return True


def next_slot(timing: Timing, *, after: datetime, runs_so_far: int = 0) -> datetime | None:
    """Return the first slot strictly after `after`, or None when there is none.

    None means the schedule is finished: max_runs is reached, the next slot
    would be past end_at, a one-off has run or is in the past, or the cron
    expression never matches again. The result is an aware UTC datetime.
    """
    _require_aware("after", after)
    _require_count("runs_so_far", runs_so_far)
    if timing.max_runs is not None and runs_so_far >= timing.max_runs:
        return None
    return next(_slots(timing, after=after, until=None, runs_so_far=runs_so_far), None)


def slots_between(
    timing: Timing,
    *,
    since: datetime,
    until: datetime,
    runs_so_far: int = 0,
    limit: int | None = None,
) -> list[datetime]:
    """Return every slot s with since < s <= until, strictly increasing, in UTC.

    The same bounds as next_slot apply; max_runs counts runs_so_far plus the
    slots returned, and limit caps the length of the list.
    """
    _require_aware("since", since)
    _require_aware("until", until)
    _require_count("runs_so_far", runs_so_far)
    if limit is not None:
        _require_count("limit", limit)
    cap = limit
    if timing.max_runs is not None:
        remaining = max(timing.max_runs - runs_so_far, 0)
        cap = remaining if cap is None else min(cap, remaining)
    if cap == 0 or until <= since:
        return []
    result: list[datetime] = []
    for slot in _slots(timing, after=since, until=until, runs_so_far=runs_so_far):
        result.append(slot)
        if cap is not None and len(result) >= cap:
            break
    return result


def count_slots(timing: Timing, *, since: datetime, until: datetime, walk: int = 500) -> int:
    """Return how many slots s with since < s <= until there are, ignoring max_runs.

    The cost does not grow with the length of the range. Interval and
    one-off slots are counted exactly by arithmetic. Cron slots are walked,
    at most ``walk`` of them; when more remain, the rest of the range is
    counted at the rate of the walked ones (exact for a cron that fires at
    a steady rate, such as ``* * * * *``; an estimate otherwise).
    """
    _require_aware("since", since)
    _require_aware("until", until)
    if not _is_count(walk) or walk == 0:
        raise ValueError(f"walk must be a whole number >= 1, got {walk!r}")
    if until <= since:
        return 0
    if timing.interval is not None and timing.days is None:
        return _count_interval(timing, since=since, until=until)
    uncapped = replace(timing, max_runs=None)
    if timing.run_at is not None:
        return len(slots_between(uncapped, since=since, until=until))
    walked = slots_between(uncapped, since=since, until=until, limit=walk)
    if len(walked) < walk:
        return len(walked)
    if timing.end_at is not None and until > timing.end_at:
        until = timing.end_at
    first = walked[0] if len(walked) > 1 else since
    spacing = (walked[-1] - first) / max(len(walked) - 1, 1)
    return len(walked) + int((until - walked[-1]) / spacing)


def longest_gap(
    timing: Timing, *, since: datetime, walk: int = 1000, span: timedelta = timedelta(days=400)
) -> timedelta | None:
    """Return the longest time between consecutive slots after ``since``; None with fewer than two slots.

    Walks up to ``walk`` slots within ``span`` of ``since`` (beyond ``span``
    only as far as it takes to find two). Days without any slot further on
    (the weekend of an every-minute weekday job) are found from the first
    slot of each day over ``span``; the gap around them is then counted from
    the first slot of the day before, up to a day longer than it is: an
    estimate on the long side.
    """
    _require_aware("since", since)
    slots = slots_between(timing, since=since, until=since + span, limit=walk)
    while len(slots) < 2:
        later = next_slot(timing, after=slots[-1] if slots else since, runs_so_far=len(slots))
        if later is None:
            return None
        slots.append(later)
    longest = max(later - earlier for earlier, later in zip(slots, slots[1:]))
    if slots[-1] - slots[0] >= span:
        return longest
    previous: datetime | None = None  # first slot of the last day that had one
    for day in range(span.days):
        start = since + timedelta(days=day)
        first = next_slot(timing, after=start - _TICK)
        if first is None:
            break
        if first >= start + timedelta(days=1):
            continue  # an empty day: the gap closes on a later day
        if previous is not None and start - previous > timedelta(days=1):  # an empty day in between
            longest = max(longest, first - previous)
        previous = first
    return longest


def _count_interval(timing: Timing, *, since: datetime, until: datetime) -> int:
    """Count interval slots in (since, until] within start_at..end_at, by arithmetic."""
    assert timing.interval is not None
    if timing.start_at is not None and timing.start_at - _TICK > since:
        since = timing.start_at - _TICK
    if timing.end_at is not None and timing.end_at < until:
        until = timing.end_at
    if until <= since:
        return 0
    anchor = _micros(timing.start_at) if timing.start_at is not None else 0
    step = timing.interval * 1_000_000
    first = max(0, (_micros(since) - anchor) // step + 1)
    last = (_micros(until) - anchor) // step
    return max(0, last - first + 1)


# --- generation ---------------------------------------------------------------


def _slots(timing: Timing, *, after: datetime, until: datetime | None, runs_so_far: int) -> Iterator[datetime]:
    """Yield slots after `after` within start_at..end_at and until, increasing."""
    # start_at is inclusive: searching after the instant just before it
    # admits a slot exactly at start_at.
    if timing.start_at is not None and timing.start_at - _TICK > after:
        after = timing.start_at - _TICK
    upper = timing.end_at
    if until is not None and (upper is None or until < upper):
        upper = until
    after = after.astimezone(UTC)
    upper = upper.astimezone(UTC) if upper is not None else None
    if upper is not None and upper <= after:
        return

    if timing.run_at is not None:
        run_at = timing.run_at.astimezone(UTC)
        if runs_so_far == 0 and run_at > after and (upper is None or run_at <= upper):
            yield run_at
        return

    yield from _on_days(timing, after=after, upper=upper)


def _candidates(timing: Timing, *, after: datetime, upper: datetime | None) -> Iterator[datetime]:
    if timing.interval is not None:
        candidates = _interval_slots(timing, after=after, upper=upper)
    else:
        assert timing.cron is not None  # Timing.__post_init__ guarantees one kind
        candidates = _cron_slots(timing, after=after, upper=upper)
    for slot in candidates:
        if upper is not None and slot > upper:
            return
        yield slot


def _on_days(timing: Timing, *, after: datetime, upper: datetime | None) -> Iterator[datetime]:
    """The candidates on days its calendars let it fire on; an excluded day is stepped over whole.

    At most ``CALENDAR_DAYS_SKIPPED`` excluded days in a row: a calendar
    that keeps every day out ends the schedule rather than the search.
    """
    if timing.days is None:
        yield from _candidates(timing, after=after, upper=upper)
        return
    zone = ZoneInfo(timing.timezone)
    skipped = 0
    while skipped <= CALENDAR_DAYS_SKIPPED:
        for slot in _candidates(timing, after=after, upper=upper):
            day = slot.astimezone(zone).date()
            if timing.days.excluded_by(day) is None:
                skipped = 0
                yield slot
                continue
            skipped += 1
            # On from the first instant of the next day in the zone (a day may start at 01:00 after a gap).
            next_day = datetime.combine(day + timedelta(days=1), time(), tzinfo=zone)
            after = max(next_day.astimezone(UTC) - _TICK, slot)
            break
        else:
            return


def excluded_slots(
    timing: Timing, *, after: datetime, count: int, runs_so_far: int = 0
) -> list[tuple[datetime, str | None]]:
    """The next ``count`` slots after ``after`` as if no calendar applied, each with the calendar that keeps it out.

    ``max_runs`` counts only the slots that fire.
    """
    _require_aware("after", after)
    days, zone = timing.days, ZoneInfo(timing.timezone)
    remaining = None if timing.max_runs is None else max(timing.max_runs - runs_so_far, 0)
    result: list[tuple[datetime, str | None]] = []
    for slot in _slots(replace(timing, days=None), after=after, until=None, runs_so_far=runs_so_far):
        if len(result) >= count or remaining == 0:
            break
        excluded = days.excluded_by(slot.astimezone(zone).date()) if days is not None else None
        if excluded is None and remaining is not None:
            remaining -= 1
        result.append((slot, excluded))
    return result


def _interval_slots(timing: Timing, *, after: datetime, upper: datetime | None) -> Iterator[datetime]:
    assert timing.interval is not None
    # Integer microseconds, not float seconds, so slot k is exactly
    # anchor + k * interval however far from the anchor it lies.
    anchor = _micros(timing.start_at) if timing.start_at is not None else 0
    step = timing.interval * 1_000_000
    k = max(0, (_micros(after) - anchor) // step + 1)
    last = None if upper is None else (_micros(upper) - anchor) // step
    while last is None or k <= last:
        try:
            yield _EPOCH + timedelta(microseconds=anchor + k * step)
        except OverflowError:  # past datetime.max: there is no later slot
            return
        k += 1


def _cron_slots(timing: Timing, *, after: datetime, upper: datetime | None) -> Iterator[datetime]:
    """Each spec's slots, merged in order; an instant two specs share is one slot."""
    assert timing.cron is not None
    specs = cron_specs(timing.cron)
    if len(specs) == 1:
        yield from _spec_slots(timing, specs[0], after=after, upper=upper)
        return
    last: datetime | None = None
    for instant in heapq.merge(*(_spec_slots(timing, spec, after=after, upper=upper) for spec in specs)):
        if instant != last:
            last = instant
            yield instant


def _spec_slots(timing: Timing, spec: str, *, after: datetime, upper: datetime | None) -> Iterator[datetime]:
    cron = _parse_cron(spec, timing.hash_key)
    tz = ZoneInfo(timing.timezone)
    every_hour = cron.every_hour
    gap = "skip" if every_hour else timing.dst_gap
    fold = "both" if every_hour else timing.dst_fold

    # Wall-clock order is real-time order except among the ambiguous wall
    # times of one fold: 02:30 (first occurrence, CEST) follows 02:00 (second
    # occurrence, CET) in wall order but precedes it in real time. So the
    # instants of ambiguous wall times are held back and sorted, and released
    # at the next unambiguous wall time, whose instants cannot precede them
    # (true as long as a zone's transitions are further apart than a fold is
    # wide, which tzdata bears out). This needs no fixed lookahead, so
    # next_slot for an every-minute job costs one or two croniter steps.
    wall_after = after.astimezone(tz).replace(tzinfo=None)
    # If `after` falls in a fold, wall times earlier than its own (down to
    # the start of the fold) have second occurrences after it.
    start = wall_after - _fold_width(wall_after, tz)
    stop_wall = None if upper is None else upper.replace(tzinfo=None) + _OFFSET_BOUND

    # croniter objects carry their position, so each search steps its own
    # shallow copy of the cached, shared prototype.
    walls = copy.copy(cron.prototype)
    walls.set_current(start - _TICK, force=True)  # get_next is strict; admit `start`
    held: list[datetime] = []
    last: datetime | None = None
    while True:
        try:
            wall = walls.get_next(datetime)
        except CroniterBadDateError:
            break  # no match within croniter's max_years_between_matches
        except (ValueError, OverflowError):
            break  # ran past year 9999
        if stop_wall is not None and wall > stop_wall:
            break
        if wall - _OFFSET_BOUND > _naive_plus((last or after), _MAX_SILENCE):
            break
        instants, ambiguous = _instants_at(wall, tz, gap=gap, fold=fold)
        if ambiguous:
            held.extend(instants)
            continue
        if held:
            instants = sorted(held) + instants
            held = []
        for instant in instants:
            # The `last` check collapses duplicates; with the ordering above
            # it only ever removes equal instants.
            if instant > after and (last is None or instant > last):
                last = instant
                yield instant
    for instant in sorted(held):
        if instant > after and (last is None or instant > last):
            last = instant
            yield instant


def _instants_at(wall: datetime, tz: ZoneInfo, *, gap: str, fold: str) -> tuple[list[datetime], bool]:
    """Return the instants a wall time maps to, and whether it is ambiguous."""
    first = wall.replace(tzinfo=tz, fold=0)
    second = wall.replace(tzinfo=tz, fold=1)
    offset_first = first.utcoffset()
    offset_second = second.utcoffset()
    assert offset_first is not None and offset_second is not None
    if offset_first == offset_second:
        return [(wall - offset_first).replace(tzinfo=UTC)], False
    if first.astimezone(UTC).astimezone(tz).replace(tzinfo=None) != wall:
        # Nonexistent: fold=0 read it with the offset before the gap, so the
        # round trip lands on a different wall time after the gap.
        if gap == "skip":
            return [], False
        return [_transition(wall, tz, before=offset_first)], False
    # Ambiguous: fold=0 is the earlier instant (PEP 495), fold=1 the later.
    earlier, later = sorted((wall - offset).replace(tzinfo=UTC) for offset in (offset_first, offset_second))
    if fold == "first":
        return [earlier], True
    if fold == "last":
        return [later], True
    return [earlier, later], True


def _transition(wall: datetime, tz: ZoneInfo, *, before: timedelta) -> datetime:
    """Return the first instant after the gap that swallowed `wall`."""
    after = wall.replace(tzinfo=tz, fold=1).utcoffset()
    assert after is not None
    # Read with the later offset the wall time lies before the transition,
    # read with the earlier one after it; bisect the whole seconds between,
    # since tzdata transitions fall on whole seconds.
    low = _micros((wall - after).replace(tzinfo=UTC)) // 1_000_000
    high = -(-_micros((wall - before).replace(tzinfo=UTC)) // 1_000_000)
    while high - low > 1:
        middle = (low + high) // 2
        instant = _EPOCH + timedelta(seconds=middle)
        if instant.astimezone(tz).utcoffset() == before:
            low = middle
        else:
            high = middle
    return _EPOCH + timedelta(seconds=high)


def _fold_width(wall: datetime, tz: ZoneInfo) -> timedelta:
    offset_first = wall.replace(tzinfo=tz, fold=0).utcoffset()
    offset_second = wall.replace(tzinfo=tz, fold=1).utcoffset()
    assert offset_first is not None and offset_second is not None
    # Positive only for an ambiguous wall time; a gap gives a negative width.
    return max(offset_first - offset_second, timedelta(0))


# --- parsing ----------------------------------------------------------------


@dataclass(frozen=True)
class _Cron:
    prototype: croniter[datetime]  # never iterated itself; copied per search
    every_hour: bool
    #: The expression croniter reads: the one written, with its H fields resolved.
    text: str


@functools.lru_cache(maxsize=1024)
def _parse_cron(expr: str, hash_key: str = "") -> _Cron:
    fields = _FIELD_RE.findall(expr)
    if not fields:
        # Only non-ASCII whitespace, which croniter does not split on either.
        raise ScheduleInvalid("Cron expression is required")
    if len(fields) == 1 and fields[0].lower() in _ALIASES:
        seconds_first = False
    elif len(fields) in (5, 6):
        seconds_first = len(fields) == 6
    else:
        raise ScheduleInvalid(f"Cron expression must have 5 or 6 fields, got {len(fields)}")
    for position, field in enumerate(fields):
        if any(_RANDOM_RE.match(part) for part in field.split(",")):
            # 'R' differs from process to process: replicas would disagree on the slots.
            raise ScheduleInvalid(
                f"Invalid cron expression {expr!r}: {_field_name(position, seconds_first)} field "
                f"{field!r} uses R (random), which is not supported; H spreads schedules the same way everywhere"
            )
    resolved = [
        _resolve_hashes(field, _field_name(position, seconds_first), expr=expr, hash_key=hash_key)
        for position, field in enumerate(fields)
    ]
    try:
        # A fixed start time: croniter would otherwise read the clock.
        prototype = croniter(" ".join(resolved), _NAIVE_EPOCH, ret_type=datetime, second_at_beginning=seconds_first)
    except CroniterError as exc:
        raise ScheduleInvalid(_explain(expr, resolved, seconds_first, exc)) from exc
    return _Cron(prototype=prototype, every_hour=prototype.expanded[_HOUR] == ["*"], text=" ".join(resolved))


def _resolve_hashes(field: str, name: str, *, expr: str, hash_key: str) -> str:
    """Return the cron field with each ``H`` part replaced by the value (or stepped range) it stands for.

    ``H`` is one value in the field's range, ``H(a-b)`` one in ``a-b``,
    ``H/n`` and ``H(a-b)/n`` every n from a hashed start below n. Each field
    hashes ``hash_key`` with its own name (SHA-256), so fields spread
    independently and every process computes the same values. Days of the
    month spread over 1-28, so that every month has each.
    """
    parts = []
    for part in field.split(","):
        match = _HASH_RE.match(part)
        if match is None:
            parts.append(part)
            continue
        low, high = _HASH_RANGES[name]
        if match.group(1) is not None:
            first, last = int(match.group(1)), int(match.group(2))
            if not low <= first <= last <= high:
                raise ScheduleInvalid(
                    f"Invalid cron expression {expr!r}: {name} field {field!r}: the range of H must lie "
                    f"within {low}-{high}, first to last"
                )
            low, high = first, last
        step = int(match.group(3)) if match.group(3) is not None else None
        if step == 0:
            raise ScheduleInvalid(
                f"Invalid cron expression {expr!r}: {name} field {field!r}: a step must be at least 1"
            )
        digest = int.from_bytes(hashlib.sha256(f"{hash_key}\x00{name}".encode()).digest()[:8], "big")
        width = high - low + 1
        if step is None:
            parts.append(str(low + digest % width))
        else:
            parts.append(f"{low + digest % min(step, width)}-{high}/{step}")
    return ",".join(parts)


def _explain(expr: str, fields: list[str], seconds_first: bool, exc: CroniterError) -> str:
    """Return a message naming the first field croniter rejects on its own."""
    reason = _strip_expression(str(exc), expr)
    for position, field in enumerate(fields):
        probe = ["*"] * len(fields)
        probe[position] = field
        try:
            croniter(" ".join(probe), _NAIVE_EPOCH, second_at_beginning=seconds_first)
        except CroniterError as field_exc:
            name = _field_name(position, seconds_first)
            index = _SECONDS_FIRST_ORDER[position] if seconds_first else position
            detail = _strip_expression(str(field_exc), " ".join(probe))
            if "out of range" in detail or "out of bands" in detail:
                detail = f"is out of range {_FIELD_RANGES[index]}"
            else:
                detail = f"is not valid: {detail}" if detail else "is not valid"
            return f"Invalid cron expression {expr!r}: {name} field {field!r} {detail}"
    return f"Invalid cron expression {expr!r}: {reason or 'not valid'}"


def _strip_expression(message: str, expr: str) -> str:
    # croniter words its messages around the whole expression and its own
    # field numbers ("[*/0 * * * *] step '0' in field 0 is not acceptable");
    # keep only the part that says what is wrong.
    message = message.strip()
    prefix = f"[{expr}]"
    if message.startswith(prefix):
        message = message[len(prefix) :]
    message = re.sub(r" in field \d+", "", message)
    message = re.sub(r"^\s*is not acceptable\s*[.,]?\s*", "", message)
    return message.strip()


def _field_name(position: int, seconds_first: bool) -> str:
    return _FIELD_NAMES[_SECONDS_FIRST_ORDER[position] if seconds_first else position]


# --- small helpers ------------------------------------------------------------


def _naive_plus(moment: datetime, delta: timedelta) -> datetime:
    try:
        return moment.replace(tzinfo=None) + delta
    except OverflowError:
        return datetime.max


def _micros(moment: datetime) -> int:
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _is_aware(moment: datetime) -> bool:
    return isinstance(moment, datetime) and moment.utcoffset() is not None


def _require_aware(name: str, moment: datetime) -> None:
    if not _is_aware(moment):
        raise ValueError(f"{name} must be a timezone-aware datetime, got {moment!r}")


def _is_count(value: object) -> bool:
    # bool is an int subclass, but True is no number of seconds or runs.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require_count(name: str, value: int) -> None:
    if not _is_count(value):
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")

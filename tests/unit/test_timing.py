"""Examples for scheduler.timing: validation, bounds and the DST rules."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from scheduler.exceptions import ScheduleInvalid
from scheduler.timing import (
    Timing,
    cron_dates_problem,
    describe,
    next_slot,
    resolved_cron,
    slots_between,
    validate_cron,
    validate_timezone,
)

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TICK = timedelta(microseconds=1)
HOUR = timedelta(hours=1)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def slots_on_local_day(timing: Timing, day: date) -> list[datetime]:
    """Return the timing's slots whose wall-clock date in its zone is `day`."""
    zone = ZoneInfo(timing.timezone)
    start = datetime.combine(day, time(), tzinfo=zone).astimezone(UTC)
    end = datetime.combine(day + timedelta(days=1), time(), tzinfo=zone).astimezone(UTC)
    return slots_between(timing, since=start - TICK, until=end - TICK)


def gaps(slots: list[datetime]) -> set[timedelta]:
    return {later - earlier for earlier, later in zip(slots, slots[1:])}


# --- validate_cron -------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "30 2 * * *",
        "*/15 * * * *",
        "0 9-17 * * mon-fri",
        "0 0 L * *",
        "0 0 * * 1#2",
        "@daily",
        "*/10 * * * * *",
        "30 0 12 * * *",
    ],
)
def test_validate_cron__accepts_five_and_six_field_expressions(expr: str) -> None:
    validate_cron(expr)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("* * *", "Cron expression must have 5 or 6 fields, got 3"),
        ("* * * * * * *", "Cron expression must have 5 or 6 fields, got 7"),
        (
            "61 * * * *",
            "Invalid cron expression '61 * * * *': minute field '61' is out of range 0-59",
        ),
        (
            "0 24 * * *",
            "Invalid cron expression '0 24 * * *': hour field '24' is out of range 0-23",
        ),
        (
            "0 0 * * 8",
            "Invalid cron expression '0 0 * * 8': day-of-week field '8' is out of range 0-7",
        ),
        (
            "61 * * * * *",
            "Invalid cron expression '61 * * * * *': second field '61' is out of range 0-59",
        ),
        (
            "*/0 * * * *",
            "Invalid cron expression '*/0 * * * *': minute field '*/0' is not valid: step '0' is not acceptable",
        ),
        ("0 0 * foo *", "Invalid cron expression '0 0 * foo *': month field 'foo' is not valid"),
    ],
)
def test_validate_cron__rejects_malformed_expression_with_specific_message(expr: str, message: str) -> None:
    with pytest.raises(ScheduleInvalid) as excinfo:
        validate_cron(expr)
    assert str(excinfo.value) == message


@pytest.mark.parametrize("expr", [None, "", "   "])
def test_validate_cron__rejects_missing_expression(expr: str | None) -> None:
    with pytest.raises(ScheduleInvalid, match="^Cron expression is required$"):
        validate_cron(expr)  # type: ignore[arg-type]  # None is the point of the test


@pytest.mark.parametrize("expr", ["R * * * *", "0 R * * *", "R(0-29)/5 * * * *"])
def test_validate_cron__rejects_random_values(expr: str) -> None:
    # Replicas must agree on every slot; R differs per process.
    with pytest.raises(ScheduleInvalid, match=r"uses R \(random\), which is not supported"):
        validate_cron(expr)


@pytest.mark.parametrize("expr", ["H H * * *", "H(0-29)/10 * * * *", "H H(9-17) * * 1-5", "H H * * * *"])
def test_hashed_cron__the_same_slots_for_the_same_key_in_any_process_and_spread_by_key(expr: str) -> None:
    after = utc(2026, 3, 2)

    def slots(key: str) -> list[datetime]:
        timing = Timing(cron=expr, hash_key=key)
        return slots_between(timing, since=after, until=after + timedelta(days=2))

    # The same key: the same slots, computed afresh (no cache, no clock, no randomness)
    assert slots("acme/nightly") == slots("acme/nightly")
    assert slots("acme/nightly") and all(slot > after for slot in slots("acme/nightly"))
    # Other keys land elsewhere: 20 schedules do not all share one slot
    assert len({tuple(slots(f"acme/job-{n}")) for n in range(20)}) > 1


def test_hashed_cron__stays_within_its_range_and_step() -> None:
    for n in range(200):
        timing = Timing(cron="H(0-29)/10 H(9-17) * * *", hash_key=f"t/{n}")
        slot = next_slot(timing, after=utc(2026, 3, 2))
        assert slot is not None and 9 <= slot.hour <= 17 and slot.minute % 10 < 10 and slot.minute < 30


def test_hashed_cron__is_described_and_previewed_with_the_values_it_stands_for() -> None:
    timing = Timing(cron="H H * * *", hash_key="acme/nightly")
    resolved = resolved_cron(timing.cron, hash_key=timing.hash_key)  # type: ignore[arg-type]
    minute, hour = (int(field) for field in resolved.split()[:2])
    assert next_slot(timing, after=utc(2026, 3, 2)) == utc(2026, 3, 2, hour, minute)
    assert describe(timing) == f"At {hour:02d}:{minute:02d} (UTC)"


def test_validate_cron__accepts_expression_that_never_matches() -> None:
    validate_cron("0 0 30 2 *")


@pytest.mark.parametrize(
    ("expr", "culprit"),
    [
        ("0 0 30 2 *", "0 0 30 2 *"),
        ("0 0 31 4,6,9,11 *", "0 0 31 4,6,9,11 *"),
        ("0 12 * * *; H H 30 2 *", "H H 30 2 *"),
        ("0 0 0 31 2 *", "0 0 0 31 2 *"),
    ],
)
def test_cron_dates_problem__names_the_expression_that_matches_no_date(expr: str, culprit: str) -> None:
    assert (
        cron_dates_problem(expr, hash_key="k")
        == f"{culprit!r} matches no date (no such day in those months): it would never fire."
    )


@pytest.mark.parametrize("expr", ["0 0 29 2 *", "0 0 31 * *", "0 0 30 1-3 *", "0 0 29 2 1", "*/5 * * * *"])
def test_cron_dates_problem__none_for_expressions_with_a_date(expr: str) -> None:
    assert cron_dates_problem(expr) == ""


# --- validate_timezone ---------------------------------------------------------


@pytest.mark.parametrize("name", ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
def test_validate_timezone__accepts_iana_names(name: str) -> None:
    validate_timezone(name)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Mars/Olympus", "Unknown timezone 'Mars/Olympus'"),
        ("../etc/passwd", "Unknown timezone '../etc/passwd'"),
        ("/etc/localtime", "Unknown timezone '/etc/localtime'"),
        ("", "Timezone is required"),
        # a folder of the zone files, and a name longer than a file's: not zones, and no OSError
        ("Europe", "Unknown timezone 'Europe'"),
        ("x" * 300, f"Unknown timezone {'x' * 300!r}"),
    ],
)
def test_validate_timezone__rejects_unknown_names(name: str, message: str) -> None:
    with pytest.raises(ScheduleInvalid) as excinfo:
        validate_timezone(name)
    assert str(excinfo.value) == message


def test_validate_timezone__rejects_host_local_zone() -> None:
    # "localtime" resolves to whatever zone each host is set to.
    with pytest.raises(ScheduleInvalid, match="^Unknown timezone 'localtime'"):
        validate_timezone("localtime")


# --- Timing --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "Exactly one of cron, interval or run_at must be set, got none"),
        (
            {"cron": "* * * * *", "interval": 60},
            "Exactly one of cron, interval or run_at must be set, got cron and interval",
        ),
        ({"interval": 0}, "Interval must be a positive whole number of seconds, got 0"),
        ({"interval": True}, "Interval must be a positive whole number of seconds, got True"),
        ({"cron": "61 * * * *"}, "Invalid cron expression '61 * * * *'"),
        ({"interval": 60, "timezone": "Mars/Olympus"}, "Unknown timezone 'Mars/Olympus'"),
        ({"run_at": datetime(2025, 1, 1)}, "run_at must be a timezone-aware datetime"),
        ({"interval": 60, "start_at": datetime(2025, 1, 1)}, "start_at must be a timezone-aware"),
        (
            {"interval": 60, "start_at": utc(2025, 2, 1), "end_at": utc(2025, 1, 1)},
            "start_at (2025-02-01T00:00:00+00:00) must not be after end_at",
        ),
        ({"interval": 60, "max_runs": -1}, "max_runs must be a whole number >= 0"),
        ({"interval": 60, "dst_gap": "later"}, "dst_gap must be 'shift' or 'skip', got 'later'"),
        ({"interval": 60, "dst_fold": "second"}, "dst_fold must be 'first', 'last' or 'both'"),
    ],
)
def test_timing__rejects_invalid_fields(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleInvalid) as excinfo:
        Timing(**kwargs)  # type: ignore[arg-type]  # deliberately wrong values
    assert str(excinfo.value).startswith(message)


# --- cron: spring forward ------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "day", "transition"),
    [
        ("Europe/Berlin", date(2025, 3, 30), utc(2025, 3, 30, 1, 0)),
        ("America/New_York", date(2025, 3, 9), utc(2025, 3, 9, 7, 0)),
    ],
)
def test_cron__spring_forward_gap_shifts_to_first_instant_after_gap(zone: str, day: date, transition: datetime) -> None:
    # Given a daily job at 02:30, which does not exist on spring-forward day
    timing = Timing(cron="30 2 * * *", timezone=zone)

    # When the day's slots are computed
    slots = slots_on_local_day(timing, day)

    # Then it runs once, at the transition, which reads 03:00 local
    assert slots == [transition]
    assert slots[0].astimezone(ZoneInfo(zone)).time() == time(3, 0)


@pytest.mark.parametrize(
    ("zone", "day"),
    [("Europe/Berlin", date(2025, 3, 30)), ("America/New_York", date(2025, 3, 9))],
)
def test_cron__spring_forward_gap_with_skip_does_not_run_that_day(zone: str, day: date) -> None:
    timing = Timing(cron="30 2 * * *", timezone=zone, dst_gap="skip")

    assert slots_on_local_day(timing, day) == []
    # ... but it does run on the days either side.
    assert len(slots_on_local_day(timing, day - timedelta(days=1))) == 1
    assert len(slots_on_local_day(timing, day + timedelta(days=1))) == 1


def test_cron__shifted_gap_times_collapse_into_one_slot() -> None:
    # Given 02:00 and 02:30 (in the gap) shift to the transition, where 03:00 also falls
    timing = Timing(cron="0,30 2,3 * * *", timezone="Europe/Berlin")

    slots = slots_on_local_day(timing, date(2025, 3, 30))

    # Then the three coincide in one slot, followed by 03:30
    assert slots == [utc(2025, 3, 30, 1, 0), utc(2025, 3, 30, 1, 30)]


def test_cron__half_hour_gap_shifts_to_transition_in_lord_howe() -> None:
    # Lord Howe springs forward from 02:00 +10:30 to 02:30 +11:00.
    timing = Timing(cron="15 2 * * *", timezone="Australia/Lord_Howe")

    assert slots_on_local_day(timing, date(2025, 10, 5)) == [utc(2025, 10, 4, 15, 30)]
    skipping = Timing(cron="15 2 * * *", timezone="Australia/Lord_Howe", dst_gap="skip")
    assert slots_on_local_day(skipping, date(2025, 10, 5)) == []


# --- cron: fall back -----------------------------------------------------------


@pytest.mark.parametrize(
    ("zone", "cron", "day", "earlier", "later"),
    [
        # zone, daily wall time, fall-back day, its earlier and later instants
        (
            "Europe/Berlin",
            "30 2 * * *",
            date(2025, 10, 26),
            utc(2025, 10, 26, 0, 30),
            utc(2025, 10, 26, 1, 30),
        ),
        (
            "America/New_York",
            "30 1 * * *",
            date(2025, 11, 2),
            utc(2025, 11, 2, 5, 30),
            utc(2025, 11, 2, 6, 30),
        ),
        (
            # Lord Howe falls back half an hour, from 02:00 +11:00 to 01:30 +10:30.
            "Australia/Lord_Howe",
            "45 1 * * *",
            date(2025, 4, 6),
            utc(2025, 4, 5, 14, 45),
            utc(2025, 4, 5, 15, 15),
        ),
    ],
)
@pytest.mark.parametrize("policy", ["first", "last", "both"])
def test_cron__fall_back_fold_follows_fold_policy(
    zone: str, cron: str, day: date, earlier: datetime, later: datetime, policy: str
) -> None:
    # Given a daily job at a wall time that occurs twice on fall-back day
    timing = Timing(cron=cron, timezone=zone, dst_fold=policy)

    # When the day's slots are computed
    slots = slots_on_local_day(timing, day)

    # Then the policy picks the earlier instant, the later one, or both
    expected = {"first": [earlier], "last": [later], "both": [earlier, later]}[policy]
    assert slots == expected


def test_cron__fold_slots_are_ordered_in_real_time_not_wall_time() -> None:
    # Given 02:00 and 02:30 in Berlin's fold: in wall order 02:00 (both
    # occurrences) precedes 02:30, in real time the occurrences interleave
    timing = Timing(cron="0,30 2 * * *", timezone="Europe/Berlin", dst_fold="both")

    slots = slots_on_local_day(timing, date(2025, 10, 26))

    assert slots == [
        utc(2025, 10, 26, 0, 0),
        utc(2025, 10, 26, 0, 30),
        utc(2025, 10, 26, 1, 0),
        utc(2025, 10, 26, 1, 30),
    ]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("both", utc(2025, 10, 26, 1, 15)),
        ("last", utc(2025, 10, 26, 1, 15)),
        ("first", utc(2025, 10, 27, 1, 15)),  # the first 02:15 is already past
    ],
)
def test_next_slot__after_inside_fold_finds_second_occurrence_of_earlier_wall_time(
    policy: str, expected: datetime
) -> None:
    # Given `after` is 02:40 CEST, the first pass through Berlin's fold
    timing = Timing(cron="15 2 * * *", timezone="Europe/Berlin", dst_fold=policy)

    # When the next slot is computed
    slot = next_slot(timing, after=utc(2025, 10, 26, 0, 40))

    # Then 02:15 CET, an earlier wall time but a later instant, is next
    assert slot == expected


# --- cron: hourly across DST -----------------------------------------------------


@pytest.mark.parametrize("cron", ["0 * * * *", "0 */1 * * *", "0 0-23 * * *", "@hourly"])
@pytest.mark.parametrize(("gap", "fold"), [("shift", "first"), ("skip", "last"), ("shift", "both")])
def test_cron__hourly_runs_every_real_hour_across_fall_back(cron: str, gap: str, fold: str) -> None:
    # Given an hourly job, however its hour field is spelt and whatever its DST policies
    timing = Timing(cron=cron, timezone="Europe/Berlin", dst_gap=gap, dst_fold=fold)

    # When the slots of Berlin's 25-hour fall-back day are computed
    slots = slots_on_local_day(timing, date(2025, 10, 26))

    # Then it runs 25 times, exactly an hour apart (cronie's rule)
    assert len(slots) == 25
    assert gaps(slots) == {HOUR}
    assert slots[0] == utc(2025, 10, 25, 22, 0)


@pytest.mark.parametrize(("gap", "fold"), [("shift", "first"), ("skip", "both")])
def test_cron__hourly_runs_every_real_hour_across_spring_forward(gap: str, fold: str) -> None:
    timing = Timing(cron="0 * * * *", timezone="Europe/Berlin", dst_gap=gap, dst_fold=fold)

    slots = slots_on_local_day(timing, date(2025, 3, 30))

    # 02:00 does not exist and is not shifted onto 03:00: 23 slots an hour apart
    assert len(slots) == 23
    assert gaps(slots) == {HOUR}


def test_cron__hourly_runs_every_real_hour_across_new_york_fall_back() -> None:
    timing = Timing(cron="0 * * * *", timezone="America/New_York")

    slots = slots_on_local_day(timing, date(2025, 11, 2))

    assert len(slots) == 25
    assert gaps(slots) == {HOUR}


def test_cron__quarter_hourly_runs_every_real_quarter_hour_across_fall_back() -> None:
    timing = Timing(cron="*/15 * * * *", timezone="Europe/Berlin", dst_fold="first")

    slots = slots_on_local_day(timing, date(2025, 10, 26))

    assert len(slots) == 100
    assert gaps(slots) == {timedelta(minutes=15)}


def test_cron__every_five_seconds_runs_through_fall_back_fold() -> None:
    timing = Timing(cron="*/5 * * * * *", timezone="Europe/Berlin")

    # The fold's transition is at 01:00Z; look at the 20 minutes around it.
    slots = slots_between(timing, since=utc(2025, 10, 26, 0, 50), until=utc(2025, 10, 26, 1, 10))

    assert len(slots) == 240
    assert gaps(slots) == {timedelta(seconds=5)}


# --- cron: six fields ------------------------------------------------------------


def test_cron__six_field_expression_has_seconds_first() -> None:
    timing = Timing(cron="*/10 * * * * *")

    slots = slots_between(timing, since=utc(2025, 6, 1, 12, 0, 3), until=utc(2025, 6, 1, 12, 1))

    assert slots[0] == utc(2025, 6, 1, 12, 0, 10)
    assert len(slots) == 6
    assert gaps(slots) == {timedelta(seconds=10)}


def test_cron__six_field_daily_expression_fires_at_given_second() -> None:
    # "30 0 12 * * *" is 12:00:30 (sec min hour), not minute 30 of hour 0.
    timing = Timing(cron="30 0 12 * * *", timezone="Europe/Berlin")

    assert next_slot(timing, after=utc(2025, 6, 1)) == utc(2025, 6, 1, 10, 0, 30)


def test_cron__never_matching_expression_has_no_next_slot() -> None:
    timing = Timing(cron="0 0 30 2 *")

    assert next_slot(timing, after=utc(2025, 1, 1)) is None
    assert slots_between(timing, since=utc(2025, 1, 1), until=utc(2030, 1, 1)) == []


def test_cron__wall_time_that_never_exists_with_skip_has_no_next_slot() -> None:
    # Given 02:30 on the last Sunday of March, which never exists in Berlin
    timing = Timing(cron="30 2 * 3 L0", timezone="Europe/Berlin", dst_gap="skip")

    # Then the search gives up (after 50 silent years) instead of running to year 9999
    assert next_slot(timing, after=utc(2025, 1, 1)) is None
    # ... while with shift it runs at each year's transition
    shifting = Timing(cron="30 2 * 3 L0", timezone="Europe/Berlin")
    assert next_slot(shifting, after=utc(2025, 1, 1)) == utc(2025, 3, 30, 1, 0)
    assert next_slot(shifting, after=utc(2025, 3, 30, 1, 0)) == utc(2026, 3, 29, 1, 0)


# --- interval --------------------------------------------------------------------


def test_interval__slots_share_one_grid_whatever_after_is() -> None:
    # Given a 7-second interval without start_at, anchored on the Unix epoch
    timing = Timing(interval=7)

    # When two processes ask from different instants
    until = utc(2025, 6, 1, 12, 1)
    first = slots_between(timing, since=utc(2025, 6, 1, 12, 0, 0), until=until, limit=3)
    second = slots_between(timing, since=utc(2025, 6, 1, 12, 0, 5), until=until, limit=3)

    # Then their slots lie on the same grid
    assert all((slot - EPOCH) % timedelta(seconds=7) == timedelta(0) for slot in first + second)
    assert set(second) <= set(first) | {first[-1] + timedelta(seconds=7)}


def test_interval__slot_far_from_anchor_is_microsecond_exact() -> None:
    timing = Timing(interval=7)
    after = utc(2030, 5, 17, 12, 0, 0, 123456)

    slot = next_slot(timing, after=after)

    steps = (after - EPOCH) // timedelta(seconds=7) + 1
    assert slot == EPOCH + steps * timedelta(seconds=7)


def test_interval__is_anchored_on_start_at() -> None:
    start = utc(2025, 6, 1, 12, 0, 0, 500000)
    timing = Timing(interval=60, start_at=start)

    assert next_slot(timing, after=utc(2025, 1, 1)) == start  # start_at is inclusive
    assert next_slot(timing, after=start) == start + timedelta(seconds=60)
    assert next_slot(timing, after=start + timedelta(seconds=90)) == start + timedelta(seconds=120)


def test_interval__ignores_timezone_across_dst() -> None:
    timing = Timing(interval=3600, timezone="Europe/Berlin")

    slots = slots_on_local_day(timing, date(2025, 10, 26))

    assert len(slots) == 25
    assert gaps(slots) == {HOUR}


# --- one-off ---------------------------------------------------------------------


def test_run_at__is_the_only_slot() -> None:
    run_at = datetime(2025, 6, 1, 14, 30, tzinfo=ZoneInfo("Europe/Berlin"))
    timing = Timing(run_at=run_at)

    slot = next_slot(timing, after=utc(2025, 1, 1))

    assert slot == utc(2025, 6, 1, 12, 30)
    assert slot is not None and slot.tzinfo is UTC
    assert next_slot(timing, after=slot) is None
    assert slots_between(timing, since=utc(2025, 1, 1), until=utc(2026, 1, 1)) == [slot]


def test_run_at__has_no_slot_once_run() -> None:
    timing = Timing(run_at=utc(2025, 6, 1))

    assert next_slot(timing, after=utc(2025, 1, 1), runs_so_far=1) is None


@pytest.mark.parametrize(
    "bounds",
    [{"start_at": utc(2025, 7, 1)}, {"end_at": utc(2025, 5, 1)}, {"max_runs": 0}],
)
def test_run_at__outside_bounds_has_no_slot(bounds: dict[str, object]) -> None:
    timing = Timing(run_at=utc(2025, 6, 1), **bounds)  # type: ignore[arg-type]  # test data

    assert next_slot(timing, after=utc(2025, 1, 1)) is None


# --- bounds ----------------------------------------------------------------------


def test_next_slot__is_strictly_after_after() -> None:
    timing = Timing(cron="0 12 * * *")

    assert next_slot(timing, after=utc(2025, 6, 1, 12)) == utc(2025, 6, 2, 12)
    assert next_slot(timing, after=utc(2025, 6, 1, 12) - TICK) == utc(2025, 6, 1, 12)


def test_next_slot__accepts_after_in_any_zone_and_returns_utc() -> None:
    timing = Timing(cron="0 12 * * *")

    slot = next_slot(timing, after=datetime(2025, 6, 1, 13, tzinfo=ZoneInfo("Europe/Berlin")))

    assert slot == utc(2025, 6, 1, 12)
    assert slot is not None and slot.tzinfo is UTC


def test_next_slot__start_at_is_inclusive() -> None:
    timing = Timing(cron="0 12 * * *", start_at=utc(2025, 6, 10, 12))

    assert next_slot(timing, after=utc(2025, 6, 1)) == utc(2025, 6, 10, 12)


def test_next_slot__end_at_is_inclusive() -> None:
    timing = Timing(cron="0 12 * * *", end_at=utc(2025, 6, 10, 12))

    assert next_slot(timing, after=utc(2025, 6, 10)) == utc(2025, 6, 10, 12)
    assert next_slot(timing, after=utc(2025, 6, 10, 12)) is None


def test_next_slot__max_runs_reached_has_no_slot() -> None:
    timing = Timing(interval=60, max_runs=3)

    assert next_slot(timing, after=utc(2025, 6, 1), runs_so_far=2) is not None
    assert next_slot(timing, after=utc(2025, 6, 1), runs_so_far=3) is None


def test_next_slot__rejects_naive_after() -> None:
    with pytest.raises(ValueError, match="after must be a timezone-aware datetime"):
        next_slot(Timing(interval=60), after=datetime(2025, 6, 1))


def test_slots_between__excludes_since_and_includes_until() -> None:
    timing = Timing(cron="0 * * * *")

    slots = slots_between(timing, since=utc(2025, 6, 1, 0), until=utc(2025, 6, 1, 3))

    assert slots == [utc(2025, 6, 1, 1), utc(2025, 6, 1, 2), utc(2025, 6, 1, 3)]


def test_slots_between__limit_caps_the_list() -> None:
    timing = Timing(cron="* * * * *")

    slots = slots_between(timing, since=utc(2025, 6, 1), until=utc(2025, 6, 2), limit=5)

    assert slots == [utc(2025, 6, 1, 0, minute) for minute in range(1, 6)]
    assert slots_between(timing, since=utc(2025, 6, 1), until=utc(2025, 6, 2), limit=0) == []


def test_slots_between__max_runs_counts_earlier_runs() -> None:
    timing = Timing(interval=60, max_runs=5)

    slots = slots_between(timing, since=utc(2025, 6, 1), until=utc(2025, 6, 2), runs_so_far=3)

    assert slots == [utc(2025, 6, 1, 0, 1), utc(2025, 6, 1, 0, 2)]


def test_slots_between__respects_start_and_end() -> None:
    timing = Timing(interval=3600, start_at=utc(2025, 6, 1, 5), end_at=utc(2025, 6, 1, 7))

    slots = slots_between(timing, since=utc(2025, 6, 1), until=utc(2025, 6, 2))

    assert slots == [utc(2025, 6, 1, 5), utc(2025, 6, 1, 6), utc(2025, 6, 1, 7)]


def test_slots_between__empty_when_until_not_after_since() -> None:
    timing = Timing(cron="* * * * *")

    assert slots_between(timing, since=utc(2025, 6, 1), until=utc(2025, 6, 1)) == []
    assert slots_between(timing, since=utc(2025, 6, 2), until=utc(2025, 6, 1)) == []


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("H(30-10) * * * *", "minute field 'H(30-10)': the range of H must lie within 0-59, first to last"),
        ("0 H(0-24) * * *", "hour field 'H(0-24)': the range of H must lie within 0-23, first to last"),
        ("H/0 * * * *", "minute field 'H/0': a step must be at least 1"),
        ("0 0 H(1-31) * *", "day-of-month field 'H(1-31)': the range of H must lie within 1-28, first to last"),
    ],
)
def test_hashed_cron__a_bad_range_or_step_is_refused_naming_its_field(expr: str, message: str) -> None:
    with pytest.raises(ScheduleInvalid) as excinfo:
        validate_cron(expr, hash_key="t/n")
    assert str(excinfo.value) == f"Invalid cron expression {expr!r}: {message}"


def test_hashed_cron__aliases_and_plain_fields_are_left_as_written() -> None:
    assert resolved_cron("@hourly", hash_key="t/n") == "@hourly"
    assert resolved_cron("5 H 1 * *", hash_key="t/n").split()[::2] == ["5", "1", "*"]


def test_hashed_cron__the_hash_is_pinned_a_new_release_moves_no_ones_slots() -> None:
    # What docs/scheduling.md shows; a change here would move every H schedule's slots on upgrade.
    assert resolved_cron("H H * * *", hash_key="acme/nightly") == "34 23 * * *"


def test_several_specs__slots_are_merged_and_a_shared_slot_fires_once() -> None:
    # Weekdays at 9, Saturdays at 12, and every day at 9 again: Monday 9:00 is one slot, not two
    timing = Timing(cron="0 9 * * 1-5; 0 12 * * 6; 0 9 * * *", timezone="Europe/Berlin")
    slots = slots_between(timing, since=utc(2026, 3, 1, 23), until=utc(2026, 3, 8, 23))  # Mon 2 .. Sun 8 March
    berlin = [slot.astimezone(ZoneInfo("Europe/Berlin")) for slot in slots]
    assert [(moment.day, moment.hour) for moment in berlin] == [
        (2, 9),
        (3, 9),
        (4, 9),
        (5, 9),
        (6, 9),
        (7, 9),
        (7, 12),
        (8, 9),
    ]
    assert describe(Timing(cron="0 9 * * 1-5; 0 12 * * 6")) == (
        "At 09:00, Monday through Friday; and At 12:00, only on Saturday (UTC)"
    )


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("0 9 * * *;", "Invalid cron expression '0 9 * * *;': an empty expression between ';'"),
        ("0 9 * * *; 61 * * * *", "Invalid cron expression '61 * * * *': minute field '61' is out of range 0-59"),
        ("; ".join(["0 9 * * *"] * 9), "At most 8 cron expressions, separated by ';'; got 9"),
    ],
)
def test_several_specs__each_is_checked_and_their_number_bounded(expr: str, message: str) -> None:
    with pytest.raises(ScheduleInvalid) as excinfo:
        validate_cron(expr)
    assert str(excinfo.value) == message

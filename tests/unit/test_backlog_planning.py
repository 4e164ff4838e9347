"""Planning a backlog: counting missed slots costs the same however far behind, and max_runs comes last."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import timing
from scheduler.timing import Timing, count_slots, policies, slots_between
from scheduler.timing.policies import OverlapPlan, cap_runs, plan_due

UTC = timezone.utc
NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC)
SLOTS = tuple(NOW + timedelta(seconds=n) for n in range(4))
PROPERTY = settings(max_examples=150, deadline=None, database=None)


@pytest.fixture
def slot_computations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the slots computed one by one: each wall time a cron visits, each interval slot yielded."""
    calls = [0]
    instants_at, interval_slots = timing._instants_at, timing._interval_slots

    def counted_instants_at(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return instants_at(*args, **kwargs)

    def counted_interval_slots(*args: object, **kwargs: object) -> Iterator[datetime]:
        for slot in interval_slots(*args, **kwargs):
            calls[0] += 1
            yield slot

    monkeypatch.setattr(timing, "_instants_at", counted_instants_at)
    monkeypatch.setattr(timing, "_interval_slots", counted_interval_slots)
    yield calls


def plan_behind(spec: Timing, behind: timedelta, **options: object) -> policies.FirePlan:
    options = {"catchup_window": 300, "misfire": "run_all", **options}
    return plan_due(spec, next_run_at=NOW - behind, now=NOW, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(("later", "kept"), [(timedelta(0), True), (timedelta(microseconds=1), False)])
def test_plan_due__a_slot_exactly_the_window_old_is_within_it(later: timedelta, kept: bool) -> None:
    # Given an every-second schedule 4 s behind, planned at the instant of its latest slot or a microsecond after
    oldest = NOW - timedelta(seconds=4)
    plan = plan_due(Timing(interval=1), next_run_at=oldest, now=NOW + later, catchup_window=4, misfire="run_all")

    # Then only a slot older than the window is missed: the one at its very edge still runs
    assert (oldest in plan.run, oldest in plan.missed) == (kept, not kept)
    assert plan.run[-1] == NOW


@pytest.mark.parametrize(
    "spec", [Timing(cron="* * * * *"), Timing(cron="*/5 * * * *", timezone="Europe/Berlin"), Timing(interval=60)]
)
def test_plan_due__30_days_behind_costs_what_1_hour_behind_costs(spec: Timing, slot_computations: list[int]) -> None:
    costs = {}
    for label, behind in (
        ("1 hour", timedelta(hours=1)),
        ("1 day", timedelta(days=1)),
        ("30 days", timedelta(days=30)),
    ):
        # Given a schedule that far behind, When its due slots are planned
        slot_computations[0] = 0
        plan = plan_behind(spec, behind)
        costs[label] = slot_computations[0]
        # Then the plan reports about what it computed (each walk looks one step past its end),
        # and the same slots run
        assert abs(plan.cost - slot_computations[0]) <= 5
        assert plan.run == tuple(slots_between(spec, since=NOW - timedelta(seconds=300, microseconds=1), until=NOW))

    # Then past the first few hundred slots the cost does not grow with the backlog
    assert costs["30 days"] == costs["1 day"] <= 250, costs
    assert costs["1 hour"] <= costs["30 days"], costs


@pytest.mark.parametrize("spec", [Timing(cron="* * * * *"), Timing(interval=60)])
def test_plan_due__counts_every_missed_slot_of_a_steady_schedule(spec: Timing) -> None:
    # Given a minute schedule 30 days behind with a 5-minute catch-up window
    plan = plan_behind(spec, timedelta(days=30))
    # Then 100 slots get rows, the rest of the 30 days' slots are counted, 5 run
    assert len(plan.missed) == 100
    assert len(plan.missed) + plan.missed_not_recorded + len(plan.run) == 30 * 24 * 60
    assert len(plan.run) == 5
    assert plan.next_run_at == NOW.replace(second=0) + timedelta(minutes=1)


@PROPERTY
@given(
    interval=st.integers(min_value=1, max_value=10_000),
    anchor=st.integers(min_value=0, max_value=10**6),
    since=st.integers(min_value=0, max_value=10**7),
    length=st.integers(min_value=0, max_value=5 * 10**4),
    end=st.none() | st.integers(min_value=0, max_value=10**7),
)
def test_count_slots__interval_matches_walking_the_slots(
    interval: int, anchor: int, since: int, length: int, end: int | None
) -> None:
    base = datetime(2025, 1, 1, tzinfo=UTC)
    start_at = base + timedelta(seconds=anchor)
    end_at = None if end is None else max(start_at, base + timedelta(seconds=end))
    spec = Timing(interval=interval, start_at=start_at, end_at=end_at)
    low = base + timedelta(seconds=since, microseconds=since % 7)
    high = low + timedelta(seconds=length)
    assert count_slots(spec, since=low, until=high) == len(slots_between(spec, since=low, until=high))


def test_count_slots__cron_exact_within_the_walk_and_estimated_past_it() -> None:
    daily = Timing(cron="30 2 * * *", timezone="Europe/Berlin")
    start = datetime(2025, 1, 1, tzinfo=UTC)
    # 365 daily slots, fewer than the walk: exact
    assert count_slots(daily, since=start, until=start + timedelta(days=365), walk=400) == 365
    # past the walk: counted at the walked slots' rate
    assert count_slots(daily, since=start, until=start + timedelta(days=365), walk=50) == 365
    assert count_slots(Timing(cron="* * * * *"), since=start, until=start + timedelta(days=30), walk=10) == 30 * 1440


def test_count_slots__refuses_a_walk_of_nothing() -> None:
    with pytest.raises(ValueError, match="walk must be"):
        count_slots(Timing(cron="* * * * *"), since=NOW, until=NOW + timedelta(hours=1), walk=0)


def test_plan_due__max_runs_not_applied_before_the_misfire_policy() -> None:
    # Given max_runs=2 and five late slots inside the window, misfire=run_once
    spec = Timing(interval=10, max_runs=2)
    plan = plan_behind(spec, timedelta(seconds=40), misfire="run_once")
    # Then the latest runs and the four before are missed
    assert plan.run == (NOW.replace(second=30),)
    assert len(plan.missed) == 4


def test_cap_runs__skipped_slots_do_not_count() -> None:
    plan = policies.plan_overlap("skip", SLOTS, in_flight=0, buffered=0)
    capped, used_up = cap_runs(plan, max_runs=2, committed=0)
    assert (capped, used_up) == (plan, False)


def test_cap_runs__the_last_run_ends_the_schedule_and_later_slots_are_dropped() -> None:
    plan = OverlapPlan(run=SLOTS, buffered=None, skipped=())
    capped, used_up = cap_runs(plan, max_runs=5, committed=3)
    assert (capped.run, used_up) == (SLOTS[:2], True)
    plan = policies.plan_overlap("buffer_one", SLOTS, in_flight=0, buffered=0)
    capped, used_up = cap_runs(plan, max_runs=2, committed=1)
    assert (capped.run, capped.buffered, capped.skipped, used_up) == (SLOTS[:1], None, (), True)


def test_cap_runs__a_buffered_slot_counts() -> None:
    plan = policies.plan_overlap("buffer_one", SLOTS, in_flight=1, buffered=0)
    capped, used_up = cap_runs(plan, max_runs=3, committed=2)
    assert (capped.run, capped.buffered, capped.skipped, used_up) == ((), SLOTS[0], (), True)


def test_cap_runs__nothing_left_sends_nothing() -> None:
    plan = policies.plan_overlap("cancel_previous", SLOTS, in_flight=1, buffered=0)
    capped, used_up = cap_runs(plan, max_runs=2, committed=2)
    assert (capped.run, capped.skipped, capped.cancel_in_flight, used_up) == ((), (), False, True)


@PROPERTY
@given(
    runs=st.integers(min_value=0, max_value=4),
    max_runs=st.none() | st.integers(min_value=1, max_value=6),
    sent=st.integers(min_value=0, max_value=6),
    policy=st.sampled_from(["allow", "skip", "buffer_one", "cancel_previous"]),
    in_flight=st.integers(min_value=0, max_value=2),
)
def test_cap_runs__never_sends_more_than_max_runs(
    runs: int, max_runs: int | None, sent: int, policy: str, in_flight: int
) -> None:
    plan = policies.plan_overlap(policy, SLOTS[:runs], in_flight=in_flight, buffered=0)
    capped, used_up = cap_runs(plan, max_runs=max_runs, committed=sent)
    counted = len(capped.run) + (capped.buffered is not None)
    if max_runs is None:
        assert (capped, used_up) == (plan, False)
    else:
        assert sent + counted <= max(max_runs, sent)
        assert used_up == (sent + len(plan.run) + (plan.buffered is not None) >= max_runs)

"""Overlap policies and jitter: pure decisions the leader takes per schedule and tick."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from scheduler.timing.policies import jitter_offset, plan_overlap

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SLOTS = tuple(T0 + timedelta(seconds=n) for n in range(3))


@pytest.mark.parametrize("in_flight", [0, 1, 5])
def test_allow__runs_every_slot_whatever_is_in_flight(in_flight: int) -> None:
    plan = plan_overlap("allow", SLOTS, in_flight=in_flight, buffered=0)
    assert (plan.run, plan.buffered, plan.skipped, plan.cancel_in_flight) == (SLOTS, None, (), False)


def test_skip__idle_runs_the_first_and_skips_the_rest() -> None:
    plan = plan_overlap("skip", SLOTS, in_flight=0, buffered=0)
    assert (plan.run, plan.skipped) == (SLOTS[:1], SLOTS[1:])


def test_skip__busy_skips_all() -> None:
    plan = plan_overlap("skip", SLOTS[:1], in_flight=1, buffered=0)
    assert (plan.run, plan.skipped, plan.buffered) == ((), SLOTS[:1], None)


def test_buffer_one__busy_buffers_one_and_skips_the_rest() -> None:
    plan = plan_overlap("buffer_one", SLOTS, in_flight=1, buffered=0)
    assert (plan.run, plan.buffered, plan.skipped) == ((), SLOTS[0], SLOTS[1:])


def test_buffer_one__already_buffered_skips_everything() -> None:
    plan = plan_overlap("buffer_one", SLOTS[:1], in_flight=2, buffered=1)
    assert (plan.run, plan.buffered, plan.skipped) == ((), None, SLOTS[:1])


def test_buffer_one__idle_runs_one_buffers_the_next() -> None:
    plan = plan_overlap("buffer_one", SLOTS, in_flight=0, buffered=0)
    assert (plan.run, plan.buffered, plan.skipped) == (SLOTS[:1], SLOTS[1], SLOTS[2:])


@pytest.mark.parametrize(("in_flight", "cancel"), [(0, False), (2, True)])
def test_cancel_previous__runs_the_latest_and_cancels_what_flies(in_flight: int, cancel: bool) -> None:
    plan = plan_overlap("cancel_previous", SLOTS, in_flight=in_flight, buffered=0)
    assert (plan.run, plan.skipped, plan.cancel_in_flight) == (SLOTS[-1:], SLOTS[:-1], cancel)


def test_unknown_policy__refused() -> None:
    with pytest.raises(ValueError, match="Unknown overlap policy"):
        plan_overlap("sometimes", SLOTS, in_flight=1, buffered=0)


def test_no_slots__nothing_to_do() -> None:
    plan = plan_overlap("cancel_previous", (), in_flight=3, buffered=0)
    assert (plan.run, plan.skipped, plan.cancel_in_flight) == ((), (), False)


def test_jitter__same_for_every_caller_and_within_bounds() -> None:
    offsets = [jitter_offset(7, T0 + timedelta(minutes=n), 30) for n in range(500)]
    assert offsets == [jitter_offset(7, T0 + timedelta(minutes=n), 30) for n in range(500)]
    assert all(0 <= offset < 30 for offset in offsets)
    # spread over the range, not clustered
    assert min(offsets) < 3 and max(offsets) > 27
    assert jitter_offset(8, T0, 30) != jitter_offset(7, T0, 30)


def test_jitter__none_or_zero_means_no_delay() -> None:
    assert jitter_offset(7, T0, 0) == jitter_offset(7, T0, None) == 0.0

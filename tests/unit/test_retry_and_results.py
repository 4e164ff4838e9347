"""Retry backoff, result summaries and rate waits: pure functions of the worker guard."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.timing.policies import retry_delay
from scheduler.worker.task import RATE_WAIT_SECONDS, RESULT_SUMMARY_MAX_CHARS, _rate_wait_allowed, _result_summary


def test_retry_delay__doubles_from_the_base() -> None:
    assert [retry_delay(n, base=2, cap=1000, spread=0.0) for n in (1, 2, 3, 4)] == [2, 4, 8, 16]


def test_retry_delay__jitter_adds_at_most_half() -> None:
    assert retry_delay(3, base=1, cap=1000, spread=0.999) < 4 * 1.5
    assert retry_delay(3, base=1, cap=1000, spread=0.5) == 5.0


def test_retry_delay__capped() -> None:
    assert retry_delay(30, base=1, cap=600, spread=0.9) == 600


@given(
    attempt=st.integers(min_value=1, max_value=20),
    base=st.integers(min_value=1, max_value=300),
    spreads=st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
)
def test_retry_delay__each_delay_longer_than_the_one_before_whatever_the_jitter(
    attempt: int, base: int, spreads: tuple[float, float]
) -> None:
    cap = 10**9
    assert retry_delay(attempt + 1, base=base, cap=cap, spread=spreads[1]) > retry_delay(
        attempt, base=base, cap=cap, spread=spreads[0]
    )


def test_result_summary__json_values_kept() -> None:
    assert _result_summary({"rows": [1, 2], "ok": True}) == {"rows": [1, 2], "ok": True}
    assert _result_summary(None) is None


def test_result_summary__non_json_becomes_repr() -> None:
    assert _result_summary({1, 2}) == {"repr": "{1, 2}"}


def test_result_summary__large_values_truncated() -> None:
    summary = _result_summary("x" * (RESULT_SUMMARY_MAX_CHARS + 10))
    assert summary["length"] == RESULT_SUMMARY_MAX_CHARS + 12
    assert len(summary["truncated"]) == 1000


@pytest.mark.parametrize(
    ("time_limits", "allowed"),
    [
        (None, RATE_WAIT_SECONDS),
        ((None, None), RATE_WAIT_SECONDS),
        ((11.0, 1.0), 0.1),  # timeout 1 s and its grace: a tenth of the soft limit
        ((70.0, 60.0), RATE_WAIT_SECONDS),
        ((10.0, None), 1.0),  # a hard limit alone
    ],
)
def test_rate_wait__a_tenth_of_the_time_limit_at_most(
    time_limits: tuple[float | None, float | None] | None, allowed: float
) -> None:
    assert _rate_wait_allowed(time_limits) == pytest.approx(allowed)

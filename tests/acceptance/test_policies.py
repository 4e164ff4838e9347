"""Scheduling policies end to end: the real beat and worker, asserted on Execution rows."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import date, datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.support import tasks as test_tasks
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
UTC = timezone.utc


def make(name: str, **fields: Any) -> Schedule:
    """A schedule of ``tests.record`` (which a test worker runs and records) unless ``fields`` say otherwise."""
    fields.setdefault("task", "tests.record")
    return make_schedule(name, **fields)


def rows(target: Schedule) -> list[Execution]:
    return list(Execution.objects.filter(schedule=target).order_by("scheduled_for"))


def settled(target: Schedule, timeout: float = 20) -> list[Execution]:
    """Stop the schedule, wait until none of its executions is in flight; return them all."""
    Schedule.objects.filter(pk=target.pk).update(enabled=False, next_run_at=None)
    done = wait_until(
        lambda: not Execution.objects.filter(schedule=target, status__in=Execution.IN_FLIGHT_STATUSES).exists(),
        timeout=timeout,
    )
    assert done, [(e.scheduled_for, e.status) for e in rows(target)]
    return rows(target)


def run_intervals(client: redis.Redis) -> dict[int, tuple[float, float | None]]:
    """Return {execution id: (start, stop or None)} from the task's event log."""
    spans: dict[int, list[float | None]] = {}
    for event in test_tasks.events(client):
        span = spans.setdefault(event["execution_id"], [None, None])
        span[0 if event["event"] == "start" else 1] = event["at"]
    return {key: (start, stop) for key, (start, stop) in spans.items()}  # type: ignore[misc]


def overlapping(spans: dict[int, tuple[float, float | None]]) -> bool:
    ordered = sorted(spans.values())
    return any(later[0] < (earlier[1] or float("inf")) for earlier, later in zip(ordered, ordered[1:]))


@pytest.mark.parametrize("policy", ["allow", "skip", "buffer_one", "cancel_previous"])
def test_overlap_policy__every_second_with_a_two_and_a_half_second_task(
    policy: str, celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given a schedule every second whose task takes 2.5 s. For cancel_previous every 2 s and 5 s: each body must
    # start before the next slot (else that slot skips it, and nothing is cancelled), and a cancelled one must be
    # stopped before it ends; both are races against a loaded machine, so each gets seconds, not fractions.
    interval, seconds = (2, 5.0) if policy == "cancel_previous" else (1, 2.5)
    target = make(policy, interval=interval, overlap=policy, kwargs={"label": policy, "seconds": seconds})
    celery_processes("worker", "w1", concurrency=4).wait_for_log(r"ready\.")
    celery_processes("beat", "beat1")
    # When it has been firing for a while (for cancel_previous: while bodies started, not while slots were skipped
    # behind a beat that started late)
    recorded, enough = Execution.objects.filter(schedule=target), 6
    if policy == "cancel_previous":
        recorded, enough = recorded.filter(started_at__isnull=False), 4
    assert wait_until(lambda: recorded.count() >= enough, timeout=40)
    executions = settled(target, timeout=20 + seconds)
    spans = run_intervals(redis_client)
    by_status = {status: [e for e in executions if e.status == status] for status in Status.values}
    ran = by_status[Status.SUCCEEDED]
    # Then each policy shows in the rows
    if policy == "allow":
        assert {e.status for e in executions} == {Status.SUCCEEDED}
        assert overlapping(spans), "allow never ran two at once"
    elif policy == "skip":
        assert by_status[Status.SKIPPED] and ran
        assert {e.status for e in executions} == {Status.SUCCEEDED, Status.SKIPPED}
        assert not overlapping(spans)
    elif policy == "buffer_one":
        assert by_status[Status.SKIPPED] and ran
        assert {e.status for e in executions} == {Status.SUCCEEDED, Status.SKIPPED}
        assert not overlapping(spans)
        # a buffered slot waited for the one before it, then started right after it ended
        waited = [e for e in ran[1:] if (e.started_at - e.scheduled_for).total_seconds() > 1.0]
        assert waited, [(e.scheduled_for, e.started_at) for e in ran]
        for execution in waited:
            before = max((e for e in ran if e.scheduled_for < execution.scheduled_for), key=lambda e: e.scheduled_for)
            assert before.finished_at <= execution.started_at  # sent only once the one before it ended
    else:
        cancelled = by_status[Status.CANCELLED]
        assert len(cancelled) >= 2, [(e.scheduled_for, e.status) for e in executions]
        assert all("cancel_previous" in e.error for e in cancelled)
        # the cancelled ones that had started were stopped: no stop event
        stopped_late = [
            (e.pk, e.started_at, e.finished_at, spans[e.pk]) for e in cancelled if e.pk in spans and spans[e.pk][1]
        ]
        assert not stopped_late, stopped_late
        assert ran and ran[-1] == executions[-1]  # the latest slot ran to the end


def test_downtime__misfire_policies_and_catchup_window_exactly(celery_processes: Start) -> None:
    # Given three every-second schedules with a 4 s catch-up window, one per misfire policy
    policies = ["run_all", "run_once", "skip"]
    # (their slots half a millisecond off the database clock's grid: a pass whose
    # clock read a slot's very instant would keep the slot at the window's edge,
    # test_plan_due__a_slot_exactly_the_window_old_is_within_it, and SQLite's
    # clock has whole milliseconds)
    start_at = dbclock.now().replace(microsecond=500) - timedelta(minutes=1)
    targets = {p: make(f"misfire-{p}", interval=1, start_at=start_at, catchup_window=4, misfire=p) for p in policies}
    celery_processes("worker", "w1").wait_for_log(r"ready\.")
    first = celery_processes("beat", "beat1")
    assert wait_until(lambda: all(len(rows(t)) >= 2 for t in targets.values()), timeout=30)
    # When every beat is stopped for 10 s and one starts again
    first.send(signal.SIGTERM)
    first.popen.wait(15)
    old_token = leases.current("beat").token
    time.sleep(10)  # the downtime itself: real time during which no beat runs
    second = celery_processes("beat", "beat2")
    assert wait_until(lambda: leases.current("beat").token > old_token, timeout=20), second.log()[-3000:]
    assert wait_until(
        lambda: all(
            Execution.objects.filter(schedule=t, lease_token__gt=old_token).count() >= 16 for t in targets.values()
        ),
        timeout=40,
    ), ({t.misfire: len(rows(t)) for t in targets.values()}, second.log()[-3000:])
    for policy, target in targets.items():
        executions = rows(target)
        # Then every slot has exactly one row, none lost in the downtime
        slots = [e.scheduled_for for e in executions]
        assert slots == [slots[0] + timedelta(seconds=n) for n in range(len(slots))], policy
        # and the backlog the new leader found is split by the window and the policy
        new = [e for e in executions if e.lease_token > old_token]
        # (the first pass's rows are written by one insert and carry its
        # database time; a pass right after a slow first insert (SQLite waits
        # for its write lock) may add a slot due meanwhile, moments later)
        written = new[0].created_at
        first_tick = [e for e in new if e.created_at == written]
        assert len(first_tick) >= 10, (policy, len(first_tick))
        latest = first_tick[-1].scheduled_for
        expected_runs = {"run_all": 4, "run_once": 1, "skip": 1}[policy]
        for execution in first_tick:
            age = (latest - execution.scheduled_for).total_seconds()
            expected = Status.MISSED if age >= expected_runs else "ran"
            actual = Status.MISSED if execution.status == Status.MISSED else "ran"
            assert actual == expected, (policy, age, execution.status)
        target.refresh_from_db()
        # (a late first start also leaves missed rows, so count them all)
        assert target.total_missed == sum(e.status == Status.MISSED for e in executions)
        # and after the backlog it is on time again: every later slot ran
        assert all(e.status != Status.MISSED for e in new[len(first_tick) :]), policy


def test_one_off_max_runs_and_jitter(celery_processes: Start) -> None:
    now = dbclock.now()
    one_off = make("one-off", run_at=now + timedelta(seconds=3))
    limited = make("three-times", interval=1, max_runs=3)
    jittered = make("jittered", interval=2, jitter=2)
    celery_processes("worker", "w1", concurrency=4).wait_for_log(r"ready\.")
    celery_processes("beat", "beat1")
    # The one-off runs once and turns itself off; max_runs=3 runs three times and does too
    for target, runs in ((one_off, 1), (limited, 3)):
        assert wait_until(lambda t=target: not Schedule.objects.get(pk=t.pk).enabled, timeout=30), target.name
        executions = settled(target)
        assert [e.status for e in executions] == [Status.SUCCEEDED] * runs, target.name
        assert Schedule.objects.get(pk=target.pk).disabled_reason
    assert rows(one_off)[0].scheduled_for == one_off.run_at
    # Jitter: the delayed messages still run, once each (the delay itself, slot +
    # its deterministic offset, is asserted on the message in the integration tests)
    assert wait_until(lambda: len(rows(jittered)) >= 3, timeout=30)
    assert {e.status for e in settled(jittered)} == {Status.SUCCEEDED}


def last_sunday(year: int, month: int) -> date:
    """Return the last Sunday of ``month`` (the EU's clock-change day)."""
    day = date(year, month + 1, 1) - timedelta(days=1)
    return day - timedelta(days=(day.weekday() - 6) % 7)


def latest_change(month: int, *, before: datetime) -> datetime:
    """Return 00:00 UTC of the latest EU clock change in ``month`` whose day has fully passed."""
    for year in (before.year, before.year - 1):
        day = datetime.combine(last_sunday(year, month), datetime.min.time(), tzinfo=UTC)
        if day + timedelta(days=2) < before:
            return day
    raise AssertionError("unreachable: last year's change has always passed")


def test_dst__real_beat_fires_once_per_intended_local_time_across_both_changes(
    celery_processes: Start,
) -> None:
    """The leader replays the latest spring and autumn changes in Europe/Berlin through its catch-up path.

    The days are the most recent last Sundays of March and October that have
    passed on the database clock, so the test means the same on any date.
    They lie inside a catch-up window longer than a year, so the real beat on
    the real database clock dispatches them exactly as it would have on the
    day. No worker consumes the queue.
    """
    berlin = "Europe/Berlin"
    window = 400 * 86400

    def replay(name: str, cron: str, start: datetime, end: datetime, **policy: str) -> Schedule:
        target = make(
            name,
            task="tests.record",
            cron=cron,
            timezone=berlin,
            catchup_window=window,
            queue="dst-replay",
            start_at=start,
            end_at=end,
            **policy,
        )
        # The first slot in the range, or its start when there is none (gap-skip).
        first = (target.next_fire_times(1, after=start - timedelta(seconds=1)) or [start])[0]
        Schedule.objects.filter(pk=target.pk).update(next_run_at=first, enabled=True)
        return target

    now = dbclock.now()
    # Spring: 02:00 CET -> 03:00 CEST at 01:00 UTC. Autumn: 03:00 CEST -> 02:00 CET at 01:00 UTC.
    spring_day, autumn_day = latest_change(3, before=now), latest_change(10, before=now)
    hours = lambda day, h, m=0: day + timedelta(hours=h, minutes=m)  # noqa: E731 -- a local shorthand
    spring = (hours(spring_day, -12), hours(spring_day, 22))
    autumn = (hours(autumn_day, -12), hours(autumn_day, 23))
    cases = {
        replay("gap-shift", "30 2 * * *", *spring, dst_gap="shift"): [hours(spring_day, 1)],
        replay("gap-skip", "30 2 * * *", *spring, dst_gap="skip"): [],
        replay("fold-first", "30 2 * * *", *autumn, dst_fold="first"): [hours(autumn_day, 0, 30)],
        replay("fold-last", "30 2 * * *", *autumn, dst_fold="last"): [hours(autumn_day, 1, 30)],
        replay("fold-both", "30 2 * * *", *autumn, dst_fold="both"): [
            hours(autumn_day, 0, 30),
            hours(autumn_day, 1, 30),
        ],
    }
    # Whole local days: 23 hours on spring-forward day, 25 on fall-back day.
    hourly_spring = replay("hourly-spring", "0 * * * *", hours(spring_day, -1), hours(spring_day, 21, 59))
    hourly_autumn = replay("hourly-autumn", "0 * * * *", hours(autumn_day, -2), hours(autumn_day, 22, 59))

    celery_processes("beat", "beat1")
    everything = [*cases, hourly_spring, hourly_autumn]
    assert wait_until(
        lambda: not Schedule.objects.filter(pk__in=[t.pk for t in everything], enabled=True).exists(), timeout=60
    )

    for target, expected in cases.items():
        assert [e.scheduled_for for e in rows(target)] == expected, target.name
        assert Schedule.objects.get(pk=target.pk).disabled_reason.startswith("Past its end")
    # A cron that matches every hour runs every real hour: 23 on spring-forward day, 25 on fall-back day
    for target, count in ((hourly_spring, 23), (hourly_autumn, 25)):
        slots = [e.scheduled_for for e in rows(target)]
        assert len(slots) == len(set(slots)) == count, target.name
        assert all(b - a == timedelta(hours=1) for a, b in zip(slots, slots[1:]))

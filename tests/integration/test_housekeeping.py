"""The leader's housekeeping: its reconcile pass and broker check run on threads of their own, never hold up a tick, and need the lease."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from django.db import connection, connections

from scheduler import dbclock
from scheduler.beat import LeaderScheduler
from scheduler.models import Execution, Schedule
from scheduler.outbox import broker
from scheduler.owners import leases
from tests.support.factories import make_schedule
from tests.support.replicas import BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def beat_log() -> Iterator[_Records]:
    """Collect the housekeeping log records (the ``scheduler`` loggers do not propagate to pytest's)."""
    handler = _Records()
    logger = logging.getLogger("scheduler.beat.housekeeping")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def leader(settings: object, beat_replica: BeatReplica) -> Iterator[LeaderScheduler]:
    settings.SCHEDULER_RECONCILE_INTERVAL_SECONDS = 0  # type: ignore[attr-defined]
    scheduler = beat_replica()
    scheduler.tick()
    assert scheduler.leadership.held
    assert scheduler.housekeeping.reconciler is None
    assert scheduler.housekeeping.broker_checker is None  # the first check under a lease ran on the tick's thread
    settings.SCHEDULER_RECONCILE_INTERVAL_SECONDS = 0.001  # type: ignore[attr-defined]
    yield scheduler
    scheduler.close()
    for thread in (scheduler.housekeeping.reconciler, scheduler.housekeeping.broker_checker):
        if thread is not None:
            thread.join(timeout=30)


def unset_schedule() -> Schedule:
    """A schedule whose next_run_at got lost: the next reconcile pass recomputes it."""
    target = make_schedule("unset")
    Schedule.objects.filter(pk=target.pk).update(next_run_at=None)
    return target


def due_now(name: str) -> Schedule:
    # One run at most: one slot is due however long the tick takes to come (every second, it could owe two).
    target = make_schedule(name, interval=1, max_runs=1)
    Schedule.objects.filter(pk=target.pk).update(next_run_at=dbclock.now().replace(microsecond=0))
    return target


def test_reconcile__runs_in_its_own_thread_while_the_leader_keeps_dispatching(
    leader: LeaderScheduler, beat_log: _Records
) -> None:
    # Given a schedule reconcile has to repair, whose row another session holds locked (PostgreSQL)
    target = unset_schedule()
    blocker = None
    if connection.vendor == "postgresql":
        blocker = connections["default"].__class__(connection.settings_dict, alias="blocker")
        blocker.set_autocommit(False)
        blocker.cursor().execute("SELECT id FROM scheduler_schedule WHERE id = %s FOR UPDATE", [target.pk])
    try:
        # When the leader ticks once the reconcile interval has passed
        leader.tick()
        pass_ = leader.housekeeping.reconciler
        assert pass_ is not None
        if blocker is not None:
            # Then, while that pass waits on the row, the leader keeps dispatching
            assert pass_.is_alive()
            due = due_now("due")
            leader.tick()
            assert Execution.objects.filter(schedule=due).exists()
            # ... and never starts a second pass beside it
            leader.tick()
            assert leader.housekeeping.reconciler is pass_
            blocker.rollback()
    finally:
        if blocker is not None:
            blocker.close()
    pass_.join(timeout=30)

    # Then the pass ran on its own thread and repaired the schedule
    assert not pass_.is_alive()
    target.refresh_from_db()
    assert target.next_run_at is not None
    threads = {record.threadName for record in beat_log.records if record.getMessage().startswith("reconcile:")}
    assert threads == {"scheduler-reconcile"}


def test_reconcile__does_not_start_without_the_lease(leader: LeaderScheduler) -> None:
    # Given a leader whose lease was taken over before its next pass
    target = unset_schedule()
    lease = leader.leadership.held[0]
    leases.acquire("beat", "usurper", ttl=10, force=True)

    # When the pass is due
    leader.housekeeping.last_reconcile -= 3600
    leader.housekeeping.start_reconcile(lease)
    assert leader.housekeeping.reconciler is not None
    leader.housekeeping.reconciler.join(timeout=30)

    # Then it changed nothing
    target.refresh_from_db()
    assert target.next_run_at is None
    assert leases.current("beat").holder == "usurper"


def test_reconcile__a_failing_pass_is_logged_and_the_next_one_runs(
    leader: LeaderScheduler, beat_log: _Records, settings: object
) -> None:
    # Given a pass that fails (a setting reconcile needs is unusable)
    target = unset_schedule()
    settings.SCHEDULER_RECONCILE_INSTANCE_STALE_SECONDS = "not a number"  # type: ignore[attr-defined]
    leader.tick()
    assert leader.housekeeping.reconciler is not None
    leader.housekeeping.reconciler.join(timeout=30)
    failed = [record for record in beat_log.records if record.getMessage().startswith("reconcile failed")]
    assert failed and failed[0].threadName == "scheduler-reconcile"
    assert leader.leadership.held

    # When the setting is fixed, the next interval's pass does its work
    Schedule.objects.filter(pk=target.pk).update(next_run_at=None)
    settings.SCHEDULER_RECONCILE_INSTANCE_STALE_SECONDS = 3600  # type: ignore[attr-defined]
    leader.tick()
    leader.housekeeping.reconciler.join(timeout=30)
    target.refresh_from_db()
    assert target.next_run_at is not None
    assert target.next_run_at > dbclock.now() - timedelta(minutes=1)


def test_broker_check__first_under_a_lease_on_the_tick_then_on_its_own_thread_every_interval(
    redis_client: redis.Redis, leader: LeaderScheduler, settings: object
) -> None:
    # Given a leader that checks the broker once an hour, and checked it on its first tick (it left its marker)
    settings.SCHEDULER_BROKER_CHECK_SECONDS = 3600  # type: ignore[attr-defined]
    assert redis_client.get(broker.MARKER_KEY) is not None
    # When the broker loses its data and the leader ticks again within the hour
    redis_client.flushdb()
    leader.tick()
    # Then it does not check again
    assert leader.housekeeping.broker_checker is None and redis_client.get(broker.MARKER_KEY) is None
    # When it holds the lease under a new token (it lost it and took it again)
    again = leases.acquire("beat", leader.instance_id, ttl=10)
    assert again is not None and again.token > leader.leadership.held[0].token
    leader.housekeeping.start_broker_check(again)
    # Then it checked at once, before returning, on the caller's thread
    assert leader.housekeeping.broker_checker is None and redis_client.get(broker.MARKER_KEY) is not None
    # and once the interval has passed under that token, it checks on a thread of its own
    settings.SCHEDULER_BROKER_CHECK_SECONDS = 0.001  # type: ignore[attr-defined]
    leader.housekeeping.start_broker_check(again)
    checker = leader.housekeeping.broker_checker
    assert checker is not None and checker.name == "scheduler-broker-check"
    checker.join(timeout=30)


def test_broker_check__a_new_leader_on_a_broker_nobody_confirmed__sends_each_execution_once(
    redis_client: redis.Redis, beat_replica: BeatReplica
) -> None:
    # Given a broker the scheduler never looked at (no marker), and a schedule due now
    target = due_now("due")
    # When a new leader ticks: it commits the slot and publishes it
    scheduler = beat_replica()
    scheduler.tick()
    if scheduler.housekeeping.broker_checker is not None:
        scheduler.housekeeping.broker_checker.join(timeout=30)
    scheduler.close()
    # Then its message went out once: the broker check ran before the publish, so it did not take it for lost
    # (a second copy of a running task's message hides the first from Celery's revoke)
    execution = Execution.objects.get(schedule=target)
    headers = [json.loads(raw)["headers"] for raw in redis_client.lrange("celery", 0, -1)]
    assert [header[Execution.MESSAGE_HEADER] for header in headers] == [execution.pk]

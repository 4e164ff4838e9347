"""The beat scheduler's tick, in process: leadership, fencing, outages, and a cost that does not grow with idle schedules."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta

import pytest
from celery import beat
from celery.apps.beat import Beat
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from project.celery import app
from scheduler import dbclock, signals
from scheduler.beat import LeaderScheduler, dispatch, liveness
from scheduler.beat.scheduler import FIRES_LOGGED_ONE_BY_ONE
from scheduler.models import Execution, Instance, Schedule
from scheduler.owners import leases, schedules
from tests.support.factories import make_schedule
from tests.support.replicas import TICK_SLEEP, BeatReplica

pytestmark = pytest.mark.django_db(transaction=True)


def _load_schedules(total: int, *, due: int) -> list[int]:
    """Insert ``total`` every-minute schedules far from due; return the ids of the first ``due``."""
    far = dbclock.now() + timedelta(hours=1)
    Schedule.objects.bulk_create(
        [Schedule(name=f"s{i}", task="scheduler.echo", interval=60, next_run_at=far) for i in range(total)],
        batch_size=2000,
    )
    return list(Schedule.objects.order_by("id").values_list("id", flat=True)[:due])


def _make_due(ids: list[int]) -> None:
    """Point the schedules at their latest slot (a whole minute), so exactly one slot is due."""
    now = dbclock.now()
    Schedule.objects.filter(id__in=ids).update(next_run_at=now.replace(second=0, microsecond=0))


def test_tick_query_count__same_for_10_and_10000_schedules(beat_replica: BeatReplica) -> None:
    counts = {}
    for total in (10, 10_000):
        # Given `total` enabled schedules of which three are due, and a leader
        Execution.objects.all().delete()
        Schedule.objects.all().delete()
        due_ids = _load_schedules(total, due=3)
        scheduler = beat_replica(max_interval=TICK_SLEEP)
        _make_due(due_ids)
        scheduler.tick()  # acquires the lease and dispatches
        assert scheduler.leadership.held
        Execution.objects.all().delete()  # so the same slot can fire again
        _make_due(due_ids)
        scheduler.leadership._last_renew = time.monotonic()  # type: ignore[attr-defined]  # keep the measured tick free of a renewal
        scheduler._last_heartbeat = time.monotonic()  # and of a heartbeat, due every renewal interval

        # When one more tick dispatches the three due schedules
        with CaptureQueriesContext(connection) as queries:
            scheduler.tick()
        scheduler.close()  # the next round's leader takes the lease
        counts[total] = len(queries)
        assert Execution.objects.filter(status=Execution.Status.QUEUED).count() == 3

    # Then it took the same number of queries
    assert counts[10] == counts[10_000], counts


def test_leadership__signals_heartbeat_and_fenced_dispatch(beat_replica: BeatReplica) -> None:
    events: list[tuple[str, int, str]] = []

    def on_acquired(sender: object, instance_id: str, token: int, **kwargs: object) -> None:
        events.append(("acquired", token, ""))

    def on_lost(sender: object, instance_id: str, token: int, reason: str, **kwargs: object) -> None:
        events.append(("lost", token, reason))

    signals.leadership_acquired.connect(on_acquired)
    signals.leadership_lost.connect(on_lost)
    scheduler = beat_replica()
    usurper_lock = liveness.InstanceLock("usurper")
    try:
        # Given a replica that became leader and wrote its heartbeat
        scheduler.tick()
        token = scheduler.leadership.held[0].token
        assert events == [("acquired", token, "")]
        assert Instance.objects.get(instance_id=scheduler.instance_id).is_leader is True

        # When another instance takes the lease over and a schedule comes due
        leases.acquire("beat", "usurper", ttl=10, force=True)
        schedules.create(name="due", task="scheduler.echo", interval=60)
        Schedule.objects.update(next_run_at=dbclock.now().replace(second=0, microsecond=0))
        scheduler.leadership._last_renew = time.monotonic()  # type: ignore[attr-defined]  # it does not renew first: only the fence can stop it
        scheduler.tick()

        # Then it commits nothing, steps down and says so
        assert not Execution.objects.exists()
        assert not scheduler.leadership.held
        assert events[-1] == ("lost", token, "lost")
        if connection.vendor == "postgresql":
            # A live leader holds its instance lock; were it free, the
            # follower would take the lease as from a dead process.
            assert usurper_lock.try_acquire()
        scheduler.tick()  # as a follower: heartbeat without leadership (waits out the holder's lock on PostgreSQL)
        assert not scheduler.leadership.held
        assert Instance.objects.get(instance_id=scheduler.instance_id).is_leader is False
    finally:
        scheduler.close()
        usurper_lock.close()
        signals.leadership_acquired.disconnect(on_acquired)
        signals.leadership_lost.disconnect(on_lost)
    assert not Instance.objects.filter(instance_id=scheduler.instance_id).exists()


def test_dispatch__a_broken_schedule_is_paused_and_the_others_still_fire(lease: leases.LeaseHandle) -> None:
    # Given two due schedules, one of whose zone no longer exists
    good = schedules.create(name="good", task="scheduler.echo", interval=60)
    bad = schedules.create(name="bad", task="scheduler.echo", interval=60)
    minute = dbclock.now().replace(second=0, microsecond=0)
    Schedule.objects.update(next_run_at=minute)
    Schedule.objects.filter(pk=bad.pk).update(timezone="Gone/Away")

    # When the leader dispatches
    report = dispatch.dispatch_due(lease)

    # Then the good one fired and the bad one is paused with the reason
    assert report.fired == [("good", minute)]
    bad.refresh_from_db()
    assert "Gone/Away" in bad.paused_reason
    assert Execution.objects.filter(schedule=good).count() == 1


def test_database_outage__leader_steps_down_and_recovers(beat_replica: BeatReplica) -> None:
    scheduler = beat_replica()
    scheduler.tick()
    assert scheduler.leadership.held
    # When the database drops the beat's connection
    _cut_connection()
    delay = scheduler.tick()
    # Then it stops leading (it cannot prove its lease) without raising
    assert not scheduler.leadership.held
    assert delay > 0
    # ... and leads again once the database answers
    scheduler.tick()
    assert scheduler.leadership.held


def test_database_outage__sharded_replica_pauses_its_shards_and_retakes_them_under_new_tokens(
    beat_replica: BeatReplica, settings: object
) -> None:
    settings.SCHEDULER_SHARDS = 4  # type: ignore[attr-defined]
    scheduler = beat_replica()
    # Given a replica alone holding every shard
    scheduler.tick()
    assert sorted(scheduler.leadership.held) == [0, 1, 2, 3]
    before = {shard: lease.token for shard, lease in scheduler.leadership.held.items()}
    # When the database drops the beat's connection
    _cut_connection()
    delay = scheduler.tick()
    # Then it drops every shard (uncertain, so paused) without raising
    assert scheduler.leadership.held == {}
    assert delay > 0
    # ... and once the database answers takes them again, each under a new token
    scheduler.tick()
    after = {shard: lease.token for shard, lease in scheduler.leadership.held.items()}
    assert sorted(after) == [0, 1, 2, 3]
    assert all(after[shard] > before[shard] for shard in after)


def _cut_connection() -> None:
    """Kill this test's database connection from outside (PostgreSQL) or under Django (SQLite)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
        killer = connections["default"].__class__(connection.settings_dict, alias="killer")
        try:
            with killer.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        finally:
            killer.close()
    else:
        connection.connection.close()  # the driver connection dies under Django


def test_sigterm__whose_exit_python_dropped_in_a_weakref_callback__still_stops_beat_and_frees_the_lease(
    redis_url: str,
) -> None:
    # Given celery's beat service leading, with celery's own SIGTERM handler
    service = beat.Service(app, scheduler_cls=LeaderScheduler)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    Beat(app=app).install_sync_handler(service)
    on_sigterm = signal.getsignal(signal.SIGTERM)
    assert callable(on_sigterm)
    scheduler = service.scheduler
    scheduler.tick()
    assert scheduler.leadership.held

    # When SIGTERM lands inside a weakref callback during a tick: the
    # handler closes the scheduler, and the SystemExit it raises there is
    # printed as "Exception ignored" and dropped by Python
    class Collected:
        pass

    collected = Collected()
    dropped = weakref.ref(collected, lambda _: on_sigterm(signal.SIGTERM, None))
    follow_count = scheduler._follow_count

    def follow_count_while_collected() -> None:
        nonlocal collected
        del collected
        follow_count()

    scheduler._follow_count = follow_count_while_collected  # type: ignore[method-assign]

    def run_beat() -> None:
        try:
            service.start()
        finally:
            connections.close_all()

    runner = threading.Thread(target=run_beat, daemon=True)
    unraisable_hook, dropped_exceptions = sys.unraisablehook, []
    sys.unraisablehook = lambda unraisable: dropped_exceptions.append(unraisable.exc_type)
    try:
        runner.start()
        runner.join(10)

        # Then beat stops anyway, and gave its lease back
        assert dropped() is None and dropped_exceptions == [SystemExit]
        assert not runner.is_alive(), "beat went on after SIGTERM"
        assert not leases.current("beat").is_held
    finally:
        sys.unraisablehook = unraisable_hook
        service._is_shutdown.set()
        runner.join(10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("due", [FIRES_LOGGED_ONE_BY_ONE, FIRES_LOGGED_ONE_BY_ONE + 1])
def test_a_pass__logs_each_fire_or_one_line_for_a_burst(
    beat_replica: BeatReplica, caplog: pytest.LogCaptureFixture, due: int
) -> None:
    # Given `due` one-off schedules due at once, and a leader
    run_at = dbclock.now().replace(microsecond=0)
    for index in range(due):
        make_schedule(f"once-{index}", run_at=run_at, now=run_at - timedelta(seconds=1))
    scheduler = beat_replica(max_interval=TICK_SLEEP)
    # When one tick fires them, and each turns itself off
    with caplog.at_level(logging.INFO, logger="scheduler.beat.scheduler"):
        scheduler.tick()
    assert Execution.objects.count() == due

    # Then each fire and each schedule turned off has its own line, or the burst has one of each
    fired = [record.getMessage() for record in caplog.records if record.getMessage().startswith("dispatch")]
    off = [record.getMessage() for record in caplog.records if "turned" in record.getMessage()]
    reason = Schedule.objects.values_list("disabled_reason", flat=True).first()
    if due <= FIRES_LOGGED_ONE_BY_ONE:
        assert len(fired) == due and all(line.startswith("dispatch once-") for line in fired), fired[:3]
        assert len(off) == due and all(line.endswith(f"turned itself off: {reason}") for line in off), off[:3]
    else:
        assert fired == [f"dispatched {due} slots, {run_at.isoformat()} to {run_at.isoformat()} (token 1)"]
        assert off == [f"{due} schedules turned themselves off: {reason} ({due})"]

"""A pool child frozen inside a transaction stalls nobody (issue 16, finding 2): real beats and workers, PostgreSQL.

``tests.freeze_holding`` stops its own process (SIGSTOP) while it holds rows
locked, at one of three places:

- "checkpoint": inside the body's own ``atomic()`` right after a
  ``checkpoint()``, its execution row locked, on a ``cancel_previous``
  schedule: the leader's next slot of that schedule must cancel that row;
- "fenced": as its ``fenced()`` block records the outcome (schedule and
  execution rows locked), on a ``cancel_previous`` schedule;
- "outcome": as the guard records the outcome of a body that returned, on
  an ordinary schedule.

It stays frozen three lease TTLs. Meanwhile an every-second schedule of
another task must go on firing on time (never more than 2 × TTL late),
the leader must keep its lease (no failover), and the server must end the
frozen session (``idle_in_transaction_session_timeout``). After SIGCONT the
old body must record nothing: its claim moved on (cancelled by the next
slot, or lost and run again by another pool child).

SQLite has no such bound: a writer frozen inside a transaction holds the
whole database's write lock, and every other writer waits its busy timeout.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import connection

from scheduler import dbclock
from scheduler.models import Execution, Schedule
from scheduler.owners import leases, schedules
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, exited, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="PostgreSQL only: SQLite's one writer holds the whole database while it is frozen",
    ),
]

Start = Callable[..., CeleryProcess]
Status = Execution.Status
TTL = 4.0
#: A short lease and claim; the server ends a session idle inside a transaction after min(TTL, claim / 2) = 3 s.
SETTINGS = {
    "lease_ttl_seconds": TTL,
    "lease_renew_seconds": 1,
    "claim_seconds": 6,
    "claim_renew_seconds": 1.5,
    "reconcile_interval_seconds": 2,
}
FROZEN_SECONDS = 3 * TTL
OVERLAP = {"checkpoint": "cancel_previous", "fenced": "cancel_previous", "outcome": "allow"}


def frozen_event(client: redis.Redis) -> dict[str, Any] | None:
    return next(
        (entry for entry in test_tasks.events(client, test_tasks.HOLDING_KEY) if entry["event"] == "frozen"), None
    )


def ended(client: redis.Redis, pid: int) -> bool:
    """Whether a ``tests.freeze_holding`` run in process ``pid`` is over."""
    return any(
        entry["event"] == "ended" and entry["pid"] == pid for entry in test_tasks.events(client, test_tasks.HOLDING_KEY)
    )


def session_alive(backend_pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend_pid])
        return bool(cursor.fetchone()[0])


@pytest.mark.parametrize("where", ["checkpoint", "fenced", "outcome"])
def test_pool_child_frozen_holding_locks__others_fire_on_time_no_failover_and_it_records_nothing(
    where: str, celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given an every-second schedule, and one whose first run freezes its pool child holding locks
    ticker = Schedule(name="ticker", task="tests.record", interval=1, kwargs={"label": "tick"})
    victim = Schedule(
        name="victim", task="tests.freeze_holding", interval=3, kwargs={"where": where}, overlap=OVERLAP[where]
    )
    for schedule in (ticker, victim):
        schedule.full_clean()
        schedules.save(schedule)
    workers = [celery_processes("worker", name, concurrency=3, **SETTINGS) for name in ("w1", "w2")]
    beats = [celery_processes("beat", f"beat{index}", **SETTINGS) for index in range(2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.", timeout=60)
    frozen = wait_until(lambda: frozen_event(redis_client), timeout=60)
    assert frozen, "\n".join(process.log()[-2000:] for process in (*workers, *beats))
    frozen_at = time.time()
    execution = Execution.objects.get(pk=frozen["execution_id"])
    state = leases.current("beat")
    assert state.is_held
    try:
        # When it stays frozen for three lease TTLs
        time.sleep(FROZEN_SECONDS)
        # Then the server ended its session
        assert wait_until(lambda: not session_alive(frozen["backend_pid"]), timeout=TTL), "the frozen session lives on"
        # And the leader kept its lease: no failover
        now = leases.current("beat")
        assert (now.holder, now.token) == (state.holder, state.token) and now.is_held
        # And the ticker fired every slot meanwhile, each within 2 x TTL of its time
        since, db_now = Execution.objects.get(pk=execution.pk).created_at, dbclock.now()
        ticks = list(
            Execution.objects.filter(schedule__name="ticker", scheduled_for__gte=since)
            .order_by("scheduled_for")
            .values_list("scheduled_for", "created_at")
        )
        slots = [slot for slot, _ in ticks]
        assert slots and slots[0] <= since + timedelta(seconds=1), (since, slots)
        assert slots == [slots[0] + timedelta(seconds=index) for index in range(len(slots))], slots
        assert slots[-1] >= db_now - timedelta(seconds=2 * TTL), (db_now, slots)
        late = [(slot, created - slot) for slot, created in ticks if created - slot > timedelta(seconds=2 * TTL)]
        assert not late, late
        # And the frozen execution moved on without it: cancelled by the next slot, or run again elsewhere
        if OVERLAP[where] == "cancel_previous":
            moved = wait_until(
                lambda: Execution.objects.filter(pk=execution.pk, status=Status.CANCELLED).first(), timeout=30
            )
        else:
            moved = wait_until(
                lambda: Execution.objects.filter(pk=execution.pk, status=Status.SUCCEEDED, attempt__gt=1).first(),
                timeout=60,
            )
        assert moved, Execution.objects.filter(pk=execution.pk).values("status", "attempt", "worker").get()
    finally:
        # ... and then the frozen pool child resumes
        os.kill(frozen["pid"], signal.SIGCONT)
    # Then once its old body is over (its process gone, or the run ended)
    assert wait_until(lambda: exited(frozen["pid"]) or ended(redis_client, frozen["pid"]), timeout=30)
    # it has recorded nothing: the row stays as its successor left it
    after = Execution.objects.get(pk=execution.pk)
    assert (after.status, after.attempt, after.worker) == (moved.status, moved.attempt, moved.worker)
    assert time.time() - frozen_at >= FROZEN_SECONDS

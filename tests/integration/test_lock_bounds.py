"""Rows another transaction holds stall nobody for long (issue 16, findings 2 and 4): two connections, PostgreSQL.

A second connection, on a thread of its own, holds rows locked in an open
transaction, as a worker frozen inside its ``atomic()`` or a backfill
frozen mid-insert would. Then:

- the server ends any session of the project idle inside a transaction
  past ``session_limits.idle_in_transaction_seconds()``;
- the leader's commit leaves the schedules that need those rows for the
  next pass, at once (a ``cancel_previous`` execution in flight) or after a
  bounded wait (anything else), commits the others and keeps its lease;
- reconcile's ``mark_lost`` passes a locked row by;
- a renewal neither waits for a locked claim row nor takes it for lost, and
  a claim whose row its own body's transaction holds counts as held.

SQLite has none of this: its one writer holds the whole database (see
tests/acceptance/test_long_transaction.py for its busy renewals).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import Error, connection, transaction

from scheduler import dbclock, outbox, session_limits
from scheduler.beat import dispatch
from scheduler.models import Execution, Lease, Schedule
from scheduler.owners import executions, leases
from scheduler.owners.executions import Claim
from tests.support.factories import make_schedule
from tests.support.threads import closing_a_cycle

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="PostgreSQL only: SQLite's one writer holds the whole database, not rows",
    ),
]

Status = Execution.Status
BOUND = 30.0  # seconds: every helper thread must have stopped by then


@contextmanager
def held_by_another(work: Callable[[], Any]) -> Iterator[dict[str, Any]]:
    """Run ``work`` inside a transaction on a connection of its own, and keep that transaction open until the block ends.

    Yields what the thread saw: ``backend_pid``, and ``error`` if its
    transaction failed (the server ended its session, say). It rolls back.
    """
    ready, release, seen = threading.Event(), threading.Event(), {}

    def run() -> None:
        try:
            with transaction.atomic():
                seen["backend_pid"] = connection.connection.info.backend_pid
                work()
                ready.set()
                release.wait(BOUND)
                transaction.set_rollback(True)
        except BaseException as exc:  # noqa: BLE001 -- reported to the test
            seen["error"] = exc
        finally:
            ready.set()
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(BOUND)
    assert "error" not in seen, seen
    try:
        yield seen
    finally:
        release.set()
        thread.join(BOUND)
        assert not thread.is_alive()


def schedule(name: str, **fields: Any) -> Schedule:
    created = make_schedule(name, **fields)
    # Due now: the slot of its grid (the epoch + k * 60 s) that just passed.
    Schedule.objects.filter(pk=created.pk).update(next_run_at=dbclock.now().replace(second=0, microsecond=0))
    return Schedule.objects.get(pk=created.pk)


def running(of: Schedule | None = None, *, key: str = "e") -> Claim:
    execution = Execution.objects.create(
        idempotency_key=key,
        task="scheduler.echo",
        scheduled_for=dbclock.now(),
        status=Status.QUEUED,
        celery_task_id=f"celery-{key}",
        schedule=of,
    )
    claimed = executions.claim(
        worker="w@host:1", task="scheduler.echo", celery_task_id=f"celery-{key}", execution_id=execution.pk
    )
    assert claimed is not None
    return Claim.of(claimed)


def lock_row(claim: Claim) -> Callable[[], None]:
    """What a body's ``checkpoint()`` inside its own ``atomic()`` does to its row."""
    return lambda: executions.save_checkpoint(claim, {"done": 1})


def still_leads(lease: leases.LeaseHandle) -> bool:
    state = leases.current("beat")
    return state.is_held and (state.holder, state.token) == (lease.holder, lease.token)


# --- idle in transaction ---------------------------------------------------------------------


def dispatch_leaving_one_locked(lease: leases.LeaseHandle, *, within: float) -> None:
    """Dispatch once; assert it took under ``within`` seconds, fired only ``other``, and left one schedule locked."""
    started = time.monotonic()
    report = dispatch.dispatch_due(lease)
    elapsed = time.monotonic() - started
    assert elapsed < within, elapsed
    assert [name for name, _ in report.fired] == ["other"]
    assert report.locked == 1


def test_session__idle_inside_a_transaction_past_the_bound__ended_by_the_server(settings: Any) -> None:
    # Given a lease TTL of 1 s: sessions may sit idle inside a transaction min(1, 30 / 2) = 1 s
    settings.SCHEDULER_LEASE_TTL_SECONDS = 1
    assert session_limits.idle_in_transaction_seconds() == 1
    seen: dict[str, Any] = {}

    def idle() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'")
                    seen["setting"] = cursor.fetchone()[0]
                    seen["backend_pid"] = connection.connection.info.backend_pid
                    time.sleep(3)  # idle inside the transaction, as a frozen process would be
                    cursor.execute("SELECT 1")
        except Error as exc:
            seen["error"] = exc
        finally:
            connection.close()

    # When a new session (any process of the project) sits idle inside a transaction for 3 s
    thread = threading.Thread(target=idle)
    thread.start()
    thread.join(BOUND)
    # Then the server had set the bound and ended the session: the next statement failed
    assert seen["setting"] == "1000"
    assert isinstance(seen.get("error"), Error), seen
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [seen["backend_pid"]])
        assert cursor.fetchone()[0] == 0


def test_session__the_bound_is_under_half_the_claim_and_at_most_one_ttl(settings: Any) -> None:
    assert session_limits.idle_in_transaction_seconds() == 10  # defaults: TTL 10 s, claim 30 s
    settings.SCHEDULER_CLAIM_SECONDS = 8
    assert session_limits.idle_in_transaction_seconds() == 4


# --- the leader's commit ---------------------------------------------------------------------


def test_leader__cancel_previous_in_flight_row_locked__schedule_left_at_once_others_committed(
    lease: leases.LeaseHandle,
) -> None:
    # Given a cancel_previous schedule whose running execution a body's open transaction holds
    # (a checkpoint() inside its atomic()), and another schedule, both due
    previous = schedule("previous", overlap="cancel_previous")
    other = schedule("other")
    claim = running(previous)
    with held_by_another(lock_row(claim)):
        # When the leader dispatches
        # Then it did not wait for that transaction: the other schedule is committed,
        # the cancel_previous one left as it was for the next pass, and the leader still leads
        dispatch_leaving_one_locked(lease, within=1.0)
        assert Schedule.objects.get(pk=previous.pk).next_run_at == previous.next_run_at
        assert Execution.objects.get(pk=claim.execution_id).status == Status.RUNNING
        assert Schedule.objects.get(pk=other.pk).next_run_at > other.next_run_at
        assert still_leads(lease)
    # And once that transaction ends, the next pass cancels the execution and fires the slot
    report = dispatch.dispatch_due(lease)
    # (a minute may have turned meanwhile; cancel_previous fires only the latest of the slots due at once: if a minute turned, the newer one)
    assert any(name == "previous" and slot >= previous.next_run_at for name, slot in report.fired)
    assert report.cancelled_task_ids == ["celery-e"] and report.locked == 0
    assert Execution.objects.get(pk=claim.execution_id).status == Status.CANCELLED


def test_leader__cancel_previous_in_flight_row_in_a_publishers_batch__left_at_once_others_committed(
    lease: leases.LeaseHandle,
) -> None:
    # Given a cancel_previous schedule whose pending execution a publisher holds in the batch it is
    # pushing (issue 26, finding 7: a follower frozen there, or waiting on a silent broker), and another schedule
    previous = schedule("previous", overlap="cancel_previous")
    schedule("other")
    pending = Execution.objects.create(
        idempotency_key="in-batch",
        task="scheduler.echo",
        scheduled_for=dbclock.now(),
        celery_task_id="celery-batch",
        schedule=previous,
    )
    with held_by_another(lambda: executions.pending_rows(limit=outbox.PUBLISH_BATCH, locked=True)):
        # When the leader dispatches
        # Then it did not wait for the publisher: the other schedule is committed, the
        # cancel_previous one left for the next pass, and the leader still leads
        dispatch_leaving_one_locked(lease, within=1.0)
        assert Execution.objects.get(pk=pending.pk).status == Status.PENDING
        assert still_leads(lease)
    # And once the batch is let go, the next pass cancels the execution and fires the slot
    report = dispatch.dispatch_due(lease)
    # (cancel_previous fires only the latest of the slots due at once: if a minute turned, the newer one)
    assert any(name == "previous" and slot >= previous.next_run_at for name, slot in report.fired)
    assert Execution.objects.get(pk=pending.pk).status == Status.CANCELLED


def test_leader__a_lock_nobody_names_in_advance__waits_a_bounded_time_and_commits_the_others(
    lease: leases.LeaseHandle,
) -> None:
    # Given two due schedules, and an open transaction (a backfill, frozen) that inserted the slot one of them is due at
    blocked = schedule("blocked")
    schedule("other")
    slot = blocked.next_run_at
    insert = lambda: executions.insert(  # noqa: E731
        [executions.execution_for(blocked, slot, status=Status.PENDING, now=dbclock.now())]
    )
    with held_by_another(insert):
        # When the leader dispatches
        # Then its inserts waited at most its bound (a tenth of the TTL) and then a short one,
        # the other schedule is committed, the blocked one left, and the leader still leads
        dispatch_leaving_one_locked(lease, within=dispatch.PASS_LOCK_WAITS * session_limits.leader_lock_wait_seconds())
        assert Schedule.objects.get(pk=blocked.pk).next_run_at == slot
        assert still_leads(lease)
    # And once the other transaction rolled back, the next pass fires the slot
    # (a minute may have turned meanwhile: later slots may fire too)
    report = dispatch.dispatch_due(lease)
    assert ("blocked", slot) in report.fired and report.locked == 0


def test_leader__a_deadlock_with_another_transaction__leaves_the_schedule_for_the_next_pass_and_keeps_the_lease(
    lease: leases.LeaseHandle, settings: Any
) -> None:
    # Given a due schedule, and a transaction that inserted its slot and then wants the lease row
    # the leader's commit holds while it waits for that insert: each waits for the other
    settings.SCHEDULER_LEASE_TTL_SECONDS = 30  # the leader waits 3 s for a lock: the deadlock detector (1 s) ends it
    blocked = schedule("blocked")
    slot = blocked.next_run_at
    connection.ensure_connection()
    errors: list[BaseException] = []
    other = closing_a_cycle(
        lambda: executions.insert([executions.execution_for(blocked, slot, status=Status.PENDING, now=dbclock.now())]),
        lambda: list(Lease.objects.select_for_update().filter(name=lease.name).values_list("pk")),
        behind=connection.connection.info.backend_pid,
        errors=errors,
        timeout=BOUND,
    )
    # When the leader dispatches
    report = dispatch.dispatch_due(lease)
    other.join(BOUND)
    # Then PostgreSQL ended the leader's side; it left the schedule for the next pass and still leads,
    # and the other transaction committed
    assert not other.is_alive() and not errors, errors
    assert report.fired == [] and report.locked == 1
    assert still_leads(lease)
    assert Execution.objects.filter(schedule=blocked, scheduled_for=slot).exists()


def test_leader__rows_locked_everywhere__the_pass_ends_within_its_wait_budget(lease: leases.LeaseHandle) -> None:
    # Given forty due schedules whose slots all sit in another open transaction
    targets = [schedule(f"s{number}") for number in range(40)]
    rows = [
        executions.execution_for(target, target.next_run_at, status=Status.PENDING, now=dbclock.now())
        for target in targets
    ]
    with held_by_another(lambda: executions.insert(rows)):
        # When the leader dispatches
        started = time.monotonic()
        report = dispatch.dispatch_due(lease)
        # Then the pass gave up within its budget of lock waits, committed nothing and kept the lease
        assert time.monotonic() - started < dispatch.PASS_LOCK_WAITS * session_limits.leader_lock_wait_seconds() + 1.0
        assert report.fired == [] and report.locked == 40
        assert still_leads(lease)


# --- reconcile -------------------------------------------------------------------------------


def test_mark_lost__a_locked_row__passed_over_not_waited_for() -> None:
    # Given a running execution whose claim ran out, its row held by its frozen body's open transaction
    claim = running()
    Execution.objects.filter(pk=claim.execution_id).update(claim_expires_at=dbclock.now() - timedelta(seconds=5))
    with held_by_another(lambda: Execution.objects.filter(pk=claim.execution_id).update(progress={"done": 1})):
        # When reconcile marks expired claims lost
        started = time.monotonic()
        marked = executions.mark_lost([claim.execution_id])
        # Then it did not wait, and left that row alone
        assert time.monotonic() - started < 1.0
        assert marked == 0
    # And the next pass, the row free again, marks it lost
    assert executions.mark_lost([claim.execution_id]) == 1


# --- claim renewals --------------------------------------------------------------------------


def renew_elsewhere(claims: list[Claim], bodies: dict[Claim, int]) -> tuple[set[Claim], float]:
    """Renew on a connection of its own (the renewer's thread); return what held and how long it took."""
    result: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            result["held"] = executions.renew(claims, seconds=60, bodies=bodies)
        finally:
            result["seconds"] = time.monotonic() - started
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(BOUND)
    assert "held" in result, result
    return result["held"], result["seconds"]


def test_renew__the_row_its_own_body_holds__counts_as_held_without_waiting() -> None:
    # Given two running executions of one worker process; the body of one is inside its own
    # transaction, after a checkpoint() (its row locked until that transaction ends)
    body, other = running(key="body"), running(key="other")
    with transaction.atomic():
        assert executions.save_checkpoint(body, {"done": 1})
        own_session = connection.connection.info.backend_pid
        # When the renewer renews both, knowing the body's session
        held, seconds = renew_elsewhere([body, other], {body: own_session})
        # Then it waited for nothing, renewed the other, and counts the body's as held
        assert seconds < 1.0
        assert held == {body, other}
        # And told some other session, it counts it as not confirmed, and not as moved on
        held, seconds = renew_elsewhere([body, other], {body: own_session + 1})
        assert seconds < 1.0 and held == {other}
        assert executions.moved_on([body]) == set()
    # And the checkpoint renewed the claim with it
    assert Execution.objects.get(pk=body.execution_id).claim_expires_at > dbclock.now() + timedelta(seconds=20)

"""Every message the broker loses runs again in time, whatever else the leader is doing (issue 26, finding 8).

Real beat and worker processes on a Redis broker of the test's own. The
executions are sent while no worker runs, so their messages wait in the
broker; then the broker loses them (restarted empty, or its queue
deleted), and only then a worker starts. What the leader does not send
again never runs:

- a leader that lost its lease and took it again sent executions before
  its first broker check under the new token, and the broker restarted in
  between;
- a reconcile pass that takes long (stalled on purpose by a failpoint)
  must not hold up the broker check;
- a message lost while the broker kept running (its run id unchanged: the
  broker check cannot see it) is sent again within SPEC guarantee 9's 60 s,
  with the default settings.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable

import pytest

from scheduler import dbclock
from scheduler.models import Execution
from scheduler.outbox import broker
from scheduler.owners import leases
from tests.acceptance.test_broker_restart import OwnBroker, own_broker  # noqa: F401 -- the fixture
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
#: SPEC guarantee 9: a lost message runs within this long of the broker answering again.
RECOVERY_SECONDS = 60
#: Executions whose messages the broker loses in each test.
COUNT = 5


def record(label: str, count: int = COUNT) -> list[int]:
    """Record ``count`` pending executions of ``tests.record``; the leader sends them (outbox)."""
    now = dbclock.now()
    rows = [
        Execution(
            idempotency_key=f"{label}:{index}",
            task="tests.record",
            kwargs={"label": f"{label}{index}"},
            scheduled_for=now,
            celery_task_id=str(uuid.uuid4()),
        )
        for index in range(count)
    ]
    Execution.objects.bulk_create(rows)
    return list(Execution.objects.filter(idempotency_key__startswith=f"{label}:").values_list("pk", flat=True))


def all_queued(ids: list[int]) -> bool:
    return Execution.objects.filter(pk__in=ids, status=Status.QUEUED).count() == len(ids)


def succeeded(ids: list[int]) -> int:
    return Execution.objects.filter(pk__in=ids, status=Status.SUCCEEDED).count()


def statuses(ids: list[int]) -> list[tuple[int, str]]:
    return list(Execution.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "status"))


def confirmed(own: OwnBroker) -> bool:
    """Whether the leader has looked at the broker and confirmed its current run."""
    marker = own.client.get(broker.MARKER_KEY)
    return marker is not None and marker.decode() == own.client.info("server")["run_id"]


def sent_then_broker_restarted(label: str, own: OwnBroker, start: Start) -> tuple[list[int], float, CeleryProcess]:
    """Record executions, wait until the leader sent them (no worker runs yet), restart the broker empty, start a worker.

    Returns the executions' ids, when the broker answered again, and the worker.
    """
    ids = record(label)
    assert wait_until(lambda: all_queued(ids), timeout=30), statuses(ids)
    own.stop()
    own.start()
    answered = time.monotonic()
    return ids, answered, start("worker", "worker1")


def assert_all_succeed_within(ids: list[int], seconds: float, answered: float, beat: CeleryProcess) -> None:
    """Wait up to ``seconds`` for every one of ``ids`` to succeed; fail with their statuses and the beat's log."""
    done = wait_until(lambda: succeeded(ids) == len(ids), timeout=seconds, interval=0.5)
    assert done, f"{statuses(ids)} {time.monotonic() - answered:.0f}s after the broker answered\n{beat.log()[-3000:]}"


def test_broker_restarted_after_a_reacquire_before_the_first_check__what_the_leader_sent_since_runs(
    celery_processes: Start,
    own_broker: OwnBroker,  # noqa: F811 -- the fixture imported above
) -> None:
    # Given a leader that checks the broker every 20 s, and re-sends nothing merely for waiting
    check = 20
    beat = celery_processes(
        "beat",
        "beat0",
        lease_ttl_seconds=4,
        lease_renew_seconds=1,
        broker_check_seconds=check,
        reconcile_interval_seconds=0,
        reconcile_queued_after_seconds=3600,
    )
    assert wait_until(lambda: confirmed(own_broker), timeout=30), beat.log()[-3000:]
    first = leases.current("beat")
    # and which loses its lease (frozen past its TTL) and takes it again
    beat.send(signal.SIGSTOP)
    time.sleep(6)
    beat.send(signal.SIGCONT)
    again = wait_until(
        lambda: (state := leases.current("beat")).is_held and state.token > first.token and state, timeout=30
    )
    assert again and again.holder == first.holder, (first, again)

    # When it sends executions (no worker runs yet), and the broker restarts empty before its next check
    ids, answered, worker = sent_then_broker_restarted("reacquired", own_broker, celery_processes)
    # Then each runs within one broker check (and a margin) of the broker answering
    assert_all_succeed_within(ids, check + 15, answered, beat)
    assert beat.alive() and worker.alive()


def test_broker_restarted_while_a_reconcile_pass_is_stuck__the_broker_check_still_sends_what_it_lost(
    celery_processes: Start,
    own_broker: OwnBroker,  # noqa: F811 -- the fixture imported above
) -> None:
    # Given an execution whose worker vanished (its claim ran out), and a leader
    # whose reconcile pass stalls for ten minutes right after marking it lost
    now = dbclock.now()
    vanished = Execution.objects.create(
        idempotency_key="vanished",
        task="tests.record",
        scheduled_for=now,
        celery_task_id=str(uuid.uuid4()),
        status=Status.RUNNING,
        attempt=1,
        started_at=now,
        claim_expires_at=now,
    )
    beat = celery_processes(
        "beat",
        "beat0",
        reconcile_interval_seconds=1,
        reconcile_queued_after_seconds=3600,
        failpoints="reconcile.after_mark_lost=delay 600",
    )
    assert wait_until(lambda: confirmed(own_broker), timeout=30), beat.log()[-3000:]
    assert wait_until(lambda: Execution.objects.filter(pk=vanished.pk, status=Status.LOST).exists(), timeout=30)

    # When it sends executions (no worker runs yet), and the broker restarts empty
    ids, answered, worker = sent_then_broker_restarted("stuck", own_broker, celery_processes)
    # Then each runs within 60 s of the broker answering, the reconcile pass still stuck
    assert_all_succeed_within(ids, RECOVERY_SECONDS, answered, beat)
    assert Execution.objects.get(pk=vanished.pk).status == Status.LOST
    assert beat.alive() and worker.alive()


def test_message_lost_while_the_broker_kept_running__runs_within_60s_with_the_default_settings(
    celery_processes: Start,
    own_broker: OwnBroker,  # noqa: F811 -- the fixture imported above
) -> None:
    # Given a leader with the default settings that has looked at the broker
    beat = celery_processes("beat", "beat0")
    assert wait_until(lambda: confirmed(own_broker), timeout=30), beat.log()[-3000:]
    # and executions it sent while no worker runs
    ids = record("dropped")
    assert wait_until(lambda: all_queued(ids), timeout=30), statuses(ids)

    # When the broker loses their messages without restarting (its run id, and the marker, stay)
    assert own_broker.client.delete("celery") == 1
    lost = time.monotonic()
    assert confirmed(own_broker)
    worker = celery_processes("worker", "worker1")
    # Then each runs within 60 s all the same
    done = wait_until(lambda: succeeded(ids) == len(ids), timeout=RECOVERY_SECONDS, interval=0.5)
    assert done, f"{statuses(ids)} {time.monotonic() - lost:.0f}s after the messages were lost\n{beat.log()[-3000:]}"
    assert beat.alive() and worker.alive()

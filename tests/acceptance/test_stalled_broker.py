"""A broker that stops answering stalls no leader (issue 26, finding 7): real beats, a broker frozen with SIGSTOP.

A frozen broker (SIGSTOP, a VM pause, a network that drops packets
without a reset) still completes TCP handshakes from its listen backlog,
and then never answers a command. A push with no socket timeout waits for
ever: the leader's tick stops there, its lease runs out and another
replica takes over, only to wait on the same push (leadership flaps, SPEC
guarantee 7). The beat's broker calls must give up well within the lease
TTL, so the leader keeps its lease and keeps committing slots while the
broker is frozen, and sends them once it answers again.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from scheduler import dbclock
from scheduler.models import Execution
from scheduler.owners import leases
from tests.acceptance.test_broker_restart import OwnBroker, own_broker  # noqa: F401 -- the fixture
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
TTL = 4.0
SETTINGS = {"lease_ttl_seconds": TTL, "lease_renew_seconds": 1}
FROZEN_SECONDS = 3 * TTL


def test_broker_frozen__the_leader_keeps_its_lease_commits_on_time_and_sends_once_it_answers(
    celery_processes: Start,
    own_broker: OwnBroker,  # noqa: F811 -- the fixture imported above
) -> None:
    # Given two every-second schedules, one cancelling its previous run each slot (the leader
    # revokes its task), and two beat replicas whose leader publishes them; no worker runs them
    ticker = make_schedule("ticker", task="tests.record", interval=1, kwargs={"label": "tick"})
    canceller = make_schedule(
        "canceller", task="tests.record", interval=1, kwargs={"label": "cancel"}, overlap="cancel_previous"
    )
    beats = [celery_processes("beat", f"beat{index}", **SETTINGS) for index in range(2)]
    queued = lambda: Execution.objects.filter(schedule=ticker, status=Status.QUEUED).count()  # noqa: E731
    assert wait_until(lambda: queued() >= 2, timeout=60), "\n".join(beat.log()[-2000:] for beat in beats)
    state = leases.current("beat")
    assert state.is_held

    # When the broker is frozen for three lease TTLs
    assert own_broker.process is not None
    own_broker.process.send_signal(signal.SIGSTOP)
    frozen_at = dbclock.now()
    try:
        time.sleep(FROZEN_SECONDS)
        # Then the leader kept its lease all along: same holder and token, still held
        now = leases.current("beat")
        assert now.is_held and (now.holder, now.token) == (state.holder, state.token), (state, now)
        # And it went on committing every slot, each within 2 x TTL of its time
        db_now = dbclock.now()
        ticks = list(
            Execution.objects.filter(schedule=ticker, scheduled_for__gte=frozen_at)
            .order_by("scheduled_for")
            .values_list("scheduled_for", "created_at")
        )
        slots = [slot for slot, _ in ticks]
        assert slots and slots[-1] >= db_now - timedelta(seconds=2 * TTL), (db_now, slots)
        assert slots == [slots[0] + timedelta(seconds=index) for index in range(len(slots))], slots
        late = [(slot, created - slot) for slot, created in ticks if created - slot > timedelta(seconds=2 * TTL)]
        assert not late, late
        # And the one cancelling its previous run did too: each slot cancelled the one before
        cancelled = Execution.objects.filter(schedule=canceller, scheduled_for__gte=frozen_at, status=Status.CANCELLED)
        assert cancelled.count() >= FROZEN_SECONDS - 2 * TTL, cancelled.count()
    finally:
        # ... and then the broker answers again
        own_broker.process.send_signal(signal.SIGCONT)
    # Then what was committed meanwhile is sent: nothing stays pending
    sent = wait_until(
        lambda: not Execution.objects.filter(schedule=ticker, status=Status.PENDING, scheduled_for__lt=db_now).exists(),
        timeout=30,
    )
    assert sent, list(
        Execution.objects.filter(schedule=ticker, status=Status.PENDING).values_list("scheduled_for", flat=True)
    )
    assert all(beat.alive() for beat in beats)
    assert "leadership lost" not in "".join(beat.log() for beat in beats)

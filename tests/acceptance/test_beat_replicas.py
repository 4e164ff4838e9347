"""Real ``celery beat`` replicas and a real worker: exactly once per slot, fast failover, fencing."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import pytest
import redis

from scheduler.models import Execution, Schedule
from scheduler.owners import leases
from tests.support import tasks as test_tasks
from tests.support.factories import make_schedule
from tests.support.processes import CeleryProcess, freeze_outside_a_write, instance_lock_waiters, pid_of, wait_until
from tests.support.services import find_redis_server, free_port

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]


def make_schedules(count: int, *, every: int = 1) -> list[Schedule]:
    return [
        make_schedule(f"every-{every}s-{index}", task="tests.record", interval=every, kwargs={"label": f"s{index}"})
        for index in range(count)
    ]


def leader_process(processes: list[CeleryProcess], timeout: float = 20.0) -> CeleryProcess:
    """Return the process whose instance id holds the lease (the id embeds the pid)."""

    def find() -> CeleryProcess | None:
        state = leases.current("beat")
        if not state.is_held:
            return None
        pid = pid_of(state.holder)
        return next((p for p in processes if p.pid == pid), None)

    leader = wait_until(find, timeout=timeout)
    assert leader, "no beat replica became leader in time"
    return leader  # type: ignore[return-value]


def assert_every_slot_once(schedules: list[Schedule], *, every: int = 1) -> None:
    """Each schedule's executions cover a contiguous run of slots, one row each."""
    for schedule in schedules:
        slots = list(
            Execution.objects.filter(schedule=schedule)
            .order_by("scheduled_for")
            .values_list("scheduled_for", flat=True)
        )
        assert slots, f"{schedule.name} never fired"
        expected = [slots[0] + timedelta(seconds=every * i) for i in range(len(slots))]
        assert slots == expected, f"{schedule.name}: slots are not contiguous: {slots}"
        assert len(set(slots)) == len(slots)


#: Rows a beat sent to the broker. Rows still ``pending`` after the last beat
#: stopped are not lost: the next leader publishes them (outbox).
SENT = (Execution.Status.QUEUED, Execution.Status.RUNNING, Execution.Status.SUCCEEDED, Execution.Status.FAILED)


def wait_for_runs(client: redis.Redis, *, timeout: float = 30.0) -> list[dict]:
    """Wait until every execution sent to the broker has run; return the side-effect log."""

    def done() -> bool:
        return len(test_tasks.runs(client)) >= Execution.objects.filter(status__in=SENT).count()

    wait_until(done, timeout=timeout, interval=0.2)
    return test_tasks.runs(client)


def assert_each_ran_once(runs: list[dict]) -> None:
    task_ids = set(Execution.objects.filter(status__in=SENT).values_list("celery_task_id", flat=True))
    counts = Counter(run["task_id"] for run in runs)
    doubled = {task_id: n for task_id, n in counts.items() if n > 1}
    assert not doubled, f"executions ran more than once: {doubled}"
    assert set(counts) == task_ids, (
        f"{len(task_ids - set(counts))} executions never ran, {len(set(counts) - task_ids)} unknown runs"
    )


def test_three_replicas__every_slot_fires_exactly_once(celery_processes: Start, redis_client: redis.Redis) -> None:
    # Given five every-second schedules, three beat replicas and a worker
    schedules = make_schedules(5)
    worker = celery_processes("worker", "worker1")
    beats = [celery_processes("beat", f"beat{i}") for i in range(3)]
    worker.wait_for_log(r"ready\.", timeout=30)

    # When they run until each schedule has fired 15 slots
    assert wait_until(lambda: all(Execution.objects.filter(schedule=s).count() >= 15 for s in schedules), timeout=60), (
        "the replicas did not fire 15 slots of every schedule"
    )
    for beat in beats:
        beat.stop()

    # Then every slot has exactly one execution, and each ran exactly once
    assert_every_slot_once(schedules)
    assert_each_ran_once(wait_for_runs(redis_client))
    assert all(beat.popen.returncode is not None for beat in beats)


@pytest.mark.parametrize("kill_signal", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_leader_killed__follower_takes_over_without_losing_a_slot(
    celery_processes: Start, redis_client: redis.Redis, kill_signal: int
) -> None:
    # Given two every-second schedules and three replicas, one of them leading
    schedules = make_schedules(2)
    worker = celery_processes("worker", "worker1")
    beats = [celery_processes("beat", f"beat{i}") for i in range(3)]
    leader = leader_process(beats)
    old_token, leader_holder = leases.current("beat").token, leases.current("beat").holder
    assert wait_until(lambda: Execution.objects.filter(lease_token=old_token).count() >= 4, timeout=15)

    # When the leader is killed
    leader.send(kill_signal)
    leader.assert_exits(15)

    # Then another replica leads and dispatches again. How fast is measured
    # by bench/failover.py; here the bound only keeps a broken takeover from
    # hanging the test (a SIGKILLed leader on SQLite waits out its 10 s TTL).
    def new_token_execution() -> Execution | None:
        return Execution.objects.filter(lease_token__gt=old_token).order_by("created_at").first()

    first = wait_until(new_token_execution, timeout=30)
    assert first, "no replica took over"
    assert leases.current("beat").token > old_token
    assert leases.current("beat").holder != leader_holder

    # ... and no slot was lost or doubled across the failover
    assert wait_until(lambda: Execution.objects.filter(lease_token=first.lease_token).count() >= 3, timeout=15)
    for beat in beats:
        beat.stop()
    worker.wait_for_log(r"ready\.", timeout=30)
    assert_every_slot_once(schedules)
    assert_each_ran_once(wait_for_runs(redis_client))


#: A lease long enough that a takeover well within it cannot be the TTL's doing.
LONG_TTL = {"lease_ttl_seconds": 15, "lease_renew_seconds": 2}
#: The bound for a takeover that must not wait for the TTL (a third of it).
FAST_TAKEOVER_SECONDS = 5.0


@pytest.mark.parametrize("kill_signal", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_leader_stopped__follower_leads_well_within_the_ttl(
    celery_processes: Start, db_vendor: str, kill_signal: int
) -> None:
    # Given three replicas with a 15 s lease, one leading and, on PostgreSQL,
    # the two others blocked on its instance lock
    beats = [celery_processes("beat", f"beat{i}", **LONG_TTL) for i in range(3)]
    leader = leader_process(beats)
    before = leases.current("beat")
    if db_vendor == "postgresql":
        assert wait_until(lambda: instance_lock_waiters() == 2, timeout=30), (
            "the followers are not waiting on the leader's lock"
        )

    # When the leader is stopped
    leader.send(kill_signal)

    # Then another replica leads within a third of the TTL: the release is
    # notified (SIGTERM), the dead process's lock comes free (SIGKILL on
    # PostgreSQL). A SIGKILLed leader on SQLite leaves no proof it is gone,
    # so there the lease must run out first.
    fast = kill_signal == signal.SIGTERM or db_vendor == "postgresql"
    bound = FAST_TAKEOVER_SECONDS if fast else LONG_TTL["lease_ttl_seconds"] + 10
    assert wait_until(lambda: leases.current("beat").token > before.token, timeout=bound), (
        f"no takeover within {bound}s; the lease now: {leases.current('beat')}; "
        f"the stopped leader ({'exited' if not leader.alive() else 'still running'}) logged:\n{leader.log()[-3000:]}"
    )
    after = leases.current("beat")
    assert after.holder not in ("", before.holder)
    if not fast:
        assert after.acquired_at >= before.expires_at, "an unexpired lease was taken without proof"
    if kill_signal == signal.SIGKILL and db_vendor == "postgresql":
        assert any("previous holder's session is gone" in beat.log() for beat in beats if beat is not leader)


def test_follower_waiting__stops_promptly_on_sigterm(celery_processes: Start, db_vendor: str) -> None:
    # Given a leader, and a follower whose every wait for it lasts 60 s
    leader = leader_process([celery_processes("beat", "leader")])
    token = leases.current("beat").token
    follower = celery_processes("beat", "follower", follower_retry_seconds=60)
    follower.wait_for_log(r"beat replica \S+ started", timeout=30)
    if db_vendor == "postgresql":
        assert wait_until(lambda: instance_lock_waiters() == 1, timeout=30), (
            "the follower is not blocked on the leader's lock"
        )
    else:
        time.sleep(2)  # SQLite: it sleeps between polls

    # When the follower gets SIGTERM in the middle of that wait
    follower.send(signal.SIGTERM)

    # Then it exits within a few seconds, leaves no session queued on the
    # lock, and the leader leads on undisturbed
    try:
        follower.popen.wait(10)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the waiting follower did not stop on SIGTERM; log tail:\n{follower.log()[-3000:]}"
        ) from None
    if db_vendor == "postgresql":
        assert wait_until(lambda: instance_lock_waiters() == 0, timeout=5), "the follower's lock wait outlived it"
    assert leader.alive()
    assert leases.current("beat").token == token


def test_paused_leader__commits_nothing_after_losing_the_lease(celery_processes: Start) -> None:
    # Given two replicas with a short lease, one leading
    schedules = make_schedules(2)
    settings = {"lease_ttl_seconds": 3, "lease_renew_seconds": 1}
    beats = [celery_processes("beat", f"beat{i}", **settings) for i in range(2)]
    leader = leader_process(beats)
    old_token = leases.current("beat").token
    assert wait_until(lambda: Execution.objects.filter(lease_token=old_token).exists(), timeout=10)

    # When the leader is frozen (holding no SQLite write lock) for longer than the TTL, then resumed
    freeze_outside_a_write(leader)
    frozen_count = None
    try:
        new_leader = wait_until(lambda: leases.current("beat").token > old_token, timeout=20)
        assert new_leader, "the follower did not take over from a frozen leader"
        frozen_count = Execution.objects.filter(lease_token=old_token).count()
    finally:
        leader.send(signal.SIGCONT)

    # Then it steps down and never commits under its old token again
    leader.wait_for_log(r"leadership lost by .*token %d" % old_token, timeout=10)
    time.sleep(2)
    assert Execution.objects.filter(lease_token=old_token).count() == frozen_count
    assert leader.alive(), "the old leader must stand by, not exit"
    assert leases.current("beat").token > old_token
    assert_every_slot_once(schedules)


def test_broker_outage__pending_rows_sent_once_when_it_returns(
    celery_processes: Start, process_env: dict[str, str], redis_client: redis.Redis, tmp_path
) -> None:
    # Given a beat and a worker on a broker of their own (the side-effect log
    # stays on the suite's Redis so it survives the broker restart)
    port = free_port()
    broker = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    broker_proc = subprocess.Popen(broker, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    broker_url = f"redis://127.0.0.1:{port}/0"
    process_env.update(REDIS_URL=broker_url, TEST_RUNS_REDIS_URL=process_env["REDIS_URL"])
    try:
        assert wait_until(lambda: _pings(broker_url), timeout=10)
        schedules = make_schedules(2)
        beat = celery_processes("beat", "beat0")
        worker = celery_processes("worker", "worker1")
        worker.wait_for_log(r"ready\.", timeout=30)
        time.sleep(2)

        # When the broker is down for 5 seconds
        broker_proc.kill()
        broker_proc.wait(5)
        time.sleep(5)
        stuck = Execution.objects.filter(status=Execution.Status.PENDING).count()
        broker_proc = subprocess.Popen(broker, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _pings(broker_url), timeout=10)
        if not worker.alive():
            # kombu 5.7's Redis transport can crash a worker whose broker
            # vanished (AttributeError in _connparams); in production its
            # supervisor starts it again, as here.
            worker = celery_processes("worker", "worker2")
        time.sleep(4)
        beat.stop()

        # Then beat survived, rows stayed pending meanwhile, and all ran exactly once
        assert beat.popen.returncode is not None
        assert "broker unreachable" in beat.log()
        assert stuck >= 3, "slots due during the outage should wait as pending rows"
        assert_every_slot_once(schedules)
        assert_each_ran_once(wait_for_runs(redis_client, timeout=40))
    finally:
        broker_proc.kill()
        broker_proc.wait(5)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False

"""A broker restart that loses every message: nothing fails, nothing is stranded, nothing runs twice.

Real beat and worker processes on a Redis broker of their own, restarted
empty (``--save ""``) while executions run and wait. The side-effect log
lives on the suite's Redis, so it survives the restart.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django_celery_results.models import TaskResult

from scheduler import dbclock
from scheduler.models import Execution
from scheduler.outbox import broker
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until
from tests.support.services import find_redis_server, free_port

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status

RUNNING, WAITING = 5, 20
#: The bound the product promises after the broker answers again (SPEC / issue 15).
RECOVERY_SECONDS = 60


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _record_pending(count: int, *, seconds: float) -> list[int]:
    """Record ``count`` pending executions of ``tests.record``; the leader sends them (outbox)."""
    now = dbclock.now()
    rows = [
        Execution(
            idempotency_key=f"broker-restart:{index}",
            task="tests.record",
            kwargs={"label": f"e{index}", "seconds": seconds},
            scheduled_for=now,
            celery_task_id=str(uuid.uuid4()),
        )
        for index in range(count)
    ]
    Execution.objects.bulk_create(rows)
    return list(Execution.objects.filter(idempotency_key__startswith="broker-restart:").values_list("pk", flat=True))


def _statuses() -> Counter[str]:
    return Counter(Execution.objects.values_list("status", flat=True))


def test_broker_restarted_empty__running_and_queued_executions_all_succeed_once(
    celery_processes: Start, process_env: dict[str, str], redis_client: redis.Redis
) -> None:
    # Given a leader (default settings) and a worker with 5 pool processes on a
    # broker of their own, which the leader has already looked at
    port = free_port()
    argv = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    broker_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    broker_url = f"redis://127.0.0.1:{port}/0"
    broker_client = redis.Redis.from_url(broker_url, socket_connect_timeout=1, socket_timeout=2)
    process_env.update(REDIS_URL=broker_url, TEST_RUNS_REDIS_URL=process_env["REDIS_URL"])
    try:
        assert wait_until(lambda: _pings(broker_url), timeout=10)
        worker = celery_processes("worker", "worker1", concurrency=RUNNING)
        worker.wait_for_log(r"ready\.", timeout=30)
        beat = celery_processes("beat", "beat0")
        assert wait_until(lambda: broker_client.get(broker.MARKER_KEY), timeout=30), (
            "the leader never looked at the broker"
        )

        # and 5 executions running while 20 wait (queued in Redis or prefetched by the worker)
        ids = _record_pending(RUNNING + WAITING, seconds=3)
        assert wait_until(lambda: _statuses()[Status.RUNNING] == RUNNING, timeout=30), _statuses()
        assert _statuses()[Status.QUEUED] == WAITING

        # When the broker is killed and started again, empty
        broker_proc.kill()
        broker_proc.wait(5)
        time.sleep(2)
        broker_proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _pings(broker_url), timeout=10)

        def all_succeeded() -> bool:
            nonlocal worker
            if not worker.alive():
                # kombu 5.7's Redis transport can crash a worker whose broker
                # vanished (AttributeError in _connparams, after its running
                # bodies finished); its supervisor starts it again, as here.
                worker = celery_processes("worker", f"worker{len(restarts) + 2}", concurrency=RUNNING)
                restarts.append(worker)
            return _statuses().get(Status.SUCCEEDED) == len(ids)

        # Then within 60 s of it answering every execution has succeeded
        restarts: list[CeleryProcess] = []
        finished = wait_until(all_succeeded, timeout=RECOVERY_SECONDS, interval=0.5)
        assert finished, f"{_statuses()} {RECOVERY_SECONDS}s after the broker answered again"
        assert beat.alive()
        # and each body ran exactly once: none was stopped and run again
        starts = Counter(
            event["execution_id"] for event in test_tasks.events(redis_client) if event["event"] == "start"
        )
        assert set(starts) == set(ids)
        assert {pk: n for pk, n in starts.items() if n > 1} == {}
        assert set(Execution.objects.values_list("attempt", flat=True)) == {1}
    finally:
        broker_client.close()
        broker_proc.kill()
        broker_proc.wait(5)


class OwnBroker:
    """A redis-server of the test's own, the broker of the beat and workers it starts; started empty each time."""

    def __init__(self) -> None:
        port = free_port()
        self.argv = [
            find_redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.url = f"redis://127.0.0.1:{port}/0"
        self.client = redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=2)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _pings(self.url), timeout=10), "the broker did not start"

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)


@pytest.fixture
def own_broker(process_env: dict[str, str]) -> Iterator[OwnBroker]:
    """Point the processes a test starts at a broker of its own; the side-effect log stays on the suite's Redis."""
    own = OwnBroker()
    own.start()
    process_env.update(REDIS_URL=own.url, TEST_RUNS_REDIS_URL=process_env["REDIS_URL"])
    try:
        yield own
    finally:
        own.client.close()
        own.stop()


def _record_one(key: str, **fields: Any) -> Execution:
    """Record one pending execution; the leader sends it (the test's own app talks to another broker)."""
    return Execution.objects.create(
        idempotency_key=key, scheduled_for=dbclock.now(), celery_task_id=str(uuid.uuid4()), **fields
    )


def _holding(client: redis.Redis) -> bool:
    """Whether a ``tests.flaky`` body is holding, waiting for ``GO_KEY``."""
    return any(event["event"] == "holding" for event in test_tasks.events(client, test_tasks.FENCED_KEY))


def _final(execution: Execution) -> Execution | None:
    return Execution.objects.filter(pk=execution.pk, status__in=Execution.FINAL_STATUSES).first()


def _given_up(worker: CeleryProcess, execution: Execution) -> None:
    """Wait until the guard has given up sending the retry of ``execution`` (it stays ``retrying``)."""
    worker.wait_for_log(rf"execution {execution.pk} attempt 1: its retry could not be sent", timeout=30)


def _celery_state(execution: Execution) -> str | None:
    return TaskResult.objects.filter(task_id=execution.celery_task_id).values_list("status", flat=True).first()


def test_retry_while_the_broker_is_down__sent_once_it_answers(
    celery_processes: Start, own_broker: OwnBroker, redis_client: redis.Redis
) -> None:
    # Given a worker, and a leader whose reconcile is off, so that only its
    # broker check can send a retry that could not be sent
    worker = celery_processes("worker", "worker1", concurrency=1)
    worker.wait_for_log(r"ready\.", timeout=30)
    beat = celery_processes("beat", "beat0", reconcile_interval_seconds=0)
    assert wait_until(lambda: own_broker.client.get(broker.MARKER_KEY), timeout=30), (
        "the leader never looked at the broker"
    )
    # and an execution with one retry whose first attempt runs, and fails once let go
    execution = _record_one("flaky", task="tests.flaky", args=["outage", 1, 1], max_retries=1, retry_backoff=1)
    assert wait_until(lambda: _holding(redis_client), timeout=30), worker.log()[-3000:]

    # When the broker stops, and then the body fails: Celery cannot send its retry
    own_broker.stop()
    redis_client.set(test_tasks.GO_KEY, "1")
    _given_up(worker, execution)
    # and the broker is started again, empty
    own_broker.start()

    # Then within 60 s of it answering the retry has run and succeeded: the body ran twice
    restarts: list[CeleryProcess] = []

    def finished() -> Execution | None:
        nonlocal worker
        if not worker.alive():
            # kombu 5.7's Redis transport crashes a worker whose broker vanished
            # while it held an unacknowledged message; its supervisor starts it again, as here.
            worker = celery_processes("worker", f"worker{len(restarts) + 2}", concurrency=1)
            restarts.append(worker)
        return _final(execution)

    done = wait_until(finished, timeout=RECOVERY_SECONDS, interval=0.5)
    current = Execution.objects.get(pk=execution.pk)
    assert done, f"execution {current.status} (attempt {current.attempt}) {RECOVERY_SECONDS}s after the broker answered"
    assert (done.status, done.attempt, done.result) == (Status.SUCCEEDED, 2, 2)
    assert len(test_tasks.events(redis_client, "tests:attempts:outage")) == 2
    assert beat.alive()


def test_retry_the_broker_refuses__the_pool_child_keeps_no_claim_and_runs_on(
    celery_processes: Start, own_broker: OwnBroker, redis_client: redis.Redis
) -> None:
    # Given a worker with one pool process, renewing its claims every half
    # second, and a leader that sends again what waited 2 s past its time
    worker = celery_processes("worker", "worker1", concurrency=1, claim_seconds=3, claim_renew_seconds=0.5)
    worker.wait_for_log(r"ready\.", timeout=30)
    beat = celery_processes("beat", "beat0", reconcile_interval_seconds=1, reconcile_queued_after_seconds=2)
    # and an execution with one retry whose first attempt runs, and fails once let go
    execution = _record_one("flaky", task="tests.flaky", args=["refused", 1, 1], max_retries=1, retry_backoff=1)
    assert wait_until(lambda: _holding(redis_client), timeout=30), worker.log()[-3000:]
    child = test_tasks.events(redis_client, "tests:attempts:refused")[0]["pid"]

    # When the broker takes no new connection (its clients are at its limit,
    # those open stay), and then the body fails: Celery cannot send its retry
    own_broker.client.config_set("maxclients", own_broker.client.info("clients")["connected_clients"])
    redis_client.set(test_tasks.GO_KEY, "1")
    _given_up(worker, execution)
    # Then the worker is done with the message (over the connection it kept),
    # and stores no failure for the task id: the execution is not over, and
    # its retry will reuse the id.
    assert wait_until(lambda: not own_broker.client.hlen("unacked"), timeout=15), worker.log()[-3000:]
    assert _celery_state(execution) != "FAILURE"
    # and the broker takes connections again
    own_broker.client.config_set("maxclients", 10_000)

    # Then the leader sends the retry, which runs in the same pool child and succeeds
    done = wait_until(lambda: _final(execution), timeout=RECOVERY_SECONDS, interval=0.5)
    current = Execution.objects.get(pk=execution.pk)
    assert done, f"execution {current.status} (attempt {current.attempt}) {RECOVERY_SECONDS}s after the broker answered"
    assert (done.status, done.attempt, done.result) == (Status.SUCCEEDED, 2, 2), worker.log()[-3000:]
    assert wait_until(lambda: _celery_state(execution) == "SUCCESS", timeout=10), _celery_state(execution)
    assert [event["pid"] for event in test_tasks.events(redis_client, "tests:attempts:refused")] == [child, child]
    # And that child holds no claim left over: a later task there runs to the end
    later = _record_one("later", task="tests.record", kwargs={"label": "later", "seconds": 3})
    finished = wait_until(lambda: _final(later), timeout=30)
    assert finished and finished.status == Status.SUCCEEDED, worker.log()[-3000:]
    assert [(e["event"], e["pid"]) for e in test_tasks.events(redis_client)] == [("start", child), ("stop", child)]
    assert worker.alive() and beat.alive()
    assert "stopping its body" not in worker.log()

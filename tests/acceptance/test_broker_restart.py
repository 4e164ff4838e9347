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
from collections.abc import Callable

import pytest
import redis

from scheduler import broker, leases
from scheduler.models import Execution
from tests import tasks as test_tasks
from tests.processes import CeleryProcess, wait_until
from tests.services import find_redis_server, free_port

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
    now = leases.db_now()
    rows = [
        Execution(
            idempotency_key=f"broker-restart:{index}", task="tests.record", kwargs={"label": f"e{index}", "seconds": seconds},
            scheduled_for=now, celery_task_id=str(uuid.uuid4()),
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
        assert wait_until(lambda: broker_client.get(broker.MARKER_KEY), timeout=30), "the leader never looked at the broker"

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
        starts = Counter(event["execution_id"] for event in test_tasks.events(redis_client) if event["event"] == "start")
        assert set(starts) == set(ids)
        assert {pk: n for pk, n in starts.items() if n > 1} == {}
        assert set(Execution.objects.values_list("attempt", flat=True)) == {1}
    finally:
        broker_client.close()
        broker_proc.kill()
        broker_proc.wait(5)

"""Messages published in batches (one Redis pipeline per batch) run on an unmodified worker as sent.

``scheduler.fastpath.publisher`` builds Celery's own messages and pushes each batch
in one Redis pipeline. Here more rows than one batch holds go out in one
pass, with every option the beat sets (execution id header, queue,
priority, time limits, an ETA from jitter), and a plain
``celery -A project worker`` runs them: each is claimed by its header, its
ETA and time limit are honoured, and its result is stored.

Publishing is spread over the beat replicas on PostgreSQL: a follower
publishes pending rows, and two publishers over the same rows send each one
once (row locks with ``SKIP LOCKED``). SQLite has no row locks, so there only
the leader publishes; the duplicates are counted on both.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

import pytest
import redis
from django_celery_results.models import TaskResult

from project.celery import app
from scheduler import dbclock, outbox
from scheduler.beat import liveness
from scheduler.models import Execution, Schedule
from scheduler.owners import executions, leases, schedules
from scheduler.timing import policies
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
Status = Execution.Status
QUEUE = "batched"
#: kombu's Redis transport keeps a list per priority step, named ``<queue>\x06\x16<step>``.
PRIORITY_SEP = "\x06\x16"
ROWS = outbox.PUBLISH_BATCH + 150  # more than one batch
JITTER = 4  # seconds


def pending(schedule: Schedule, slot: datetime, *, now: datetime) -> Execution:
    return executions.execution_for(schedule, slot, status=Status.PENDING, now=now)


def test_batched_messages__run_on_a_plain_worker_with_header_queue_priority_limits_and_eta(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    now = dbclock.now().replace(microsecond=0)
    # Given many pending executions on one queue, with a priority ...
    plain = schedules.create(name="plain", task="tests.record", interval=3600, queue=QUEUE, priority=3)
    rows = [pending(plain, now - timedelta(seconds=n), now=now) for n in range(ROWS)]
    # ... one delayed by its schedule's jitter: a slot due now whose offset is at least 2 s (a slot still
    # to come is not sent before it; the offset hashes the schedule's id: schedules are made until one has it)
    slot = now
    for n in range(100):
        jittered = schedules.create(
            name=f"jittered-{n}", task="tests.record", interval=3600, queue=QUEUE, jitter=JITTER
        )
        if policies.jitter_offset(jittered.pk, slot, JITTER) >= 2:
            break
    rows.append(pending(jittered, slot, now=now))
    # ... and one with a time limit it overruns
    limited = schedules.create(
        name="limited", task="tests.stubborn", interval=3600, queue=QUEUE, timeout=1, kwargs={"seconds": 30}
    )
    rows.append(pending(limited, now, now=now))
    executions.insert(rows)

    # When one publishing pass sends them all by the fast path (Redis pipelines) ...
    with outbox.connect(app) as sender:
        assert sender.fast
    assert outbox.publish_pending(app, limit=len(rows)) == len(rows)
    assert not Execution.objects.filter(status=Status.PENDING).exists()
    # ... the prioritised ones into their priority step's list, the others into the queue's own
    assert redis_client.llen(f"{QUEUE}{PRIORITY_SEP}3") == ROWS
    assert redis_client.llen(QUEUE) == 2
    # and a plain worker consumes only that queue
    worker = celery_processes("worker", "w1", queues=QUEUE, concurrency=4)

    # Then every one ran once, claimed through its header (no ad-hoc row was made for it)
    assert wait_until(
        lambda: not Execution.objects.exclude(status__in=Execution.FINAL_STATUSES).exists(), timeout=120, interval=0.5
    ), worker.log()[-3000:]
    assert not Execution.objects.exclude(schedule__isnull=False).exists(), "a message lost its execution id header"
    statuses = Counter(Execution.objects.values_list("status", flat=True))
    assert statuses == {Status.SUCCEEDED: ROWS + 1, Status.TIMED_OUT: 1}, statuses
    runs = Counter(run["task_id"] for run in test_tasks.runs(redis_client))
    assert set(runs.values()) == {1} and len(runs) == ROWS + 1
    # its result is stored by django-celery-results
    ids = Execution.objects.filter(status=Status.SUCCEEDED).values_list("celery_task_id", flat=True)
    assert TaskResult.objects.filter(task_id__in=list(ids), status="SUCCESS").count() == ROWS + 1
    # the jittered one did not start before its slot plus its offset (the ETA)
    delayed = Execution.objects.get(schedule=jittered)
    assert delayed.started_at >= slot + timedelta(seconds=policies.jitter_offset(jittered.pk, slot, JITTER))
    # and the time limit stopped the one that overran it
    assert "time limit" in Execution.objects.get(schedule=limited).error.lower()


@pytest.fixture
def lease_held_elsewhere(db_vendor: str) -> Iterator[None]:
    """Hold the beat lease in this process (and, on PostgreSQL, the holder's instance lock), so beats started stay followers."""
    lock = liveness.InstanceLock("elsewhere")
    if db_vendor == "postgresql":
        # Without it, a beat would find the holder's process gone and take the lease.
        assert lock.try_acquire()
    assert leases.acquire("beat", "elsewhere", ttl=600) is not None
    yield
    lock.close()


def _pending_rows(count: int) -> list[int]:
    now = dbclock.now()
    # Disabled: a leader commits nothing more for it, only these rows wait.
    schedule = schedules.create(name="many", task="tests.record", interval=3600, enabled=False)
    rows = [pending(schedule, now - timedelta(seconds=n), now=now) for n in range(count)]
    executions.insert(rows)
    return list(Execution.objects.values_list("pk", flat=True))


def _none_pending() -> bool:
    return not Execution.objects.filter(status=Status.PENDING).exists()


def _sent_ids(client: redis.Redis) -> list[int]:
    return [json.loads(raw)["headers"][Execution.MESSAGE_HEADER] for raw in client.lrange("celery", 0, -1)]


def test_follower__publishes_pending_rows_where_rows_lock(
    lease_held_elsewhere: None, celery_processes: Start, redis_client: redis.Redis, db_vendor: str
) -> None:
    # Given a lease held elsewhere, so the beat started stays a follower
    beat = celery_processes("beat", "follower")
    beat.wait_for_log(r"beat replica \S+ started", timeout=30)
    # When pending rows appear (the leader elsewhere committed them)
    ids = _pending_rows(50)
    if db_vendor == "postgresql":
        # Then the follower sends them and marks them queued, once each, without leading
        assert wait_until(_none_pending, timeout=30), beat.log()[-3000:]
        assert sorted(_sent_ids(redis_client)) == sorted(ids)
    else:
        # Then on SQLite (no row locks, one writer) it leaves them to the leader
        assert not wait_until(_none_pending, timeout=5)
        assert _sent_ids(redis_client) == []
    assert leases.current("beat").holder == "elsewhere"
    assert "leadership acquired" not in beat.log()


def test_two_publishers__every_row_queued_and_duplicates_counted(
    request: pytest.FixtureRequest, celery_processes: Start, redis_client: redis.Redis, db_vendor: str
) -> None:
    # Given two beats: on PostgreSQL two followers that both publish (the lease
    # is held elsewhere); on SQLite a leader and a follower (only the leader publishes)
    if db_vendor == "postgresql":
        request.getfixturevalue("lease_held_elsewhere")
    beats = [celery_processes("beat", f"publisher{n}") for n in (1, 2)]
    for beat in beats:
        beat.wait_for_log(r"beat replica \S+ started", timeout=30)
    # When 2,000 pending rows appear at once
    ids = _pending_rows(2000)
    # Then every row is queued and sent ...
    assert wait_until(_none_pending, timeout=60, interval=0.2), [beat.log()[-2000:] for beat in beats]
    sent = Counter(_sent_ids(redis_client))
    assert set(sent) == set(ids)
    duplicates = sum(sent.values()) - len(sent)
    print(f"two publishers on {db_vendor}: {len(ids)} rows, {duplicates} sent twice")
    # ... each once (PostgreSQL: SKIP LOCKED keeps the two off each other's rows)
    assert duplicates == 0

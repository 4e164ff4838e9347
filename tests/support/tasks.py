"""Tasks used by the acceptance tests; workers load them with ``--include tests.support.tasks``.

Each writes its side effects to Redis lists the test reads back, so a test can
tell how many times, and when, a body really ran.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_failure, task_postrun
from django.conf import settings
from django.db import Error, connection, transaction

import scheduler
from scheduler.exceptions import ClaimLost

#: Redis list every run of ``tests.record`` appends to: the side-effect log.
RUNS_KEY = "tests:runs"
#: Redis list of ``{"event": "start"|"stop", ...}`` entries from ``tests.record``.
EVENTS_KEY = "tests:events"
#: Redis list of what ``tests.fenced_invoice`` did: "holding", "claim lost", "committed".
FENCED_KEY = "tests:fenced"
#: Redis key whose existence lets a holding ``tests.fenced_invoice`` go on.
GO_KEY = "tests:go"
#: Redis list of the items ``tests.checkpointed`` processed, with the attempt that did each.
ITEMS_KEY = "tests:items"
#: Table (no model: tests create it) that ``tests.fenced_invoice`` inserts its one row into.
SIDE_EFFECT_TABLE = "test_side_effect"
#: Redis list of ``{"task_id": id}`` entries: Celery's ``task_failure`` for ``tests.stubborn``.
FAILURES_KEY = "tests:failures"
#: Longest a test task waits for a signal from its test.
WAIT_SECONDS = 60.0


def publish_record_by_hand(
    label: str, message_id: str, *, serializer: str = "json", headers: dict[str, Any] | None = None
) -> None:
    """Publish a ``tests.record`` message built by hand, as a client with broker access could, past ``send_task``."""
    from project.celery import app

    with app.producer_or_acquire() as producer:
        producer.publish(
            {"args": [], "kwargs": {"label": label}, "embed": {}},
            serializer=serializer,
            routing_key="celery",
            exchange="",
            headers={"task": "tests.record", "id": message_id, "lang": "py", **(headers or {})},
        )


def _client() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("TEST_RUNS_REDIS_URL") or settings.REDIS_URL)


def _event(client: redis.Redis, key: str, **fields: Any) -> None:
    client.rpush(key, json.dumps({"at": time.time(), "pid": os.getpid(), **fields}))


@shared_task(name="tests.record", bind=True)
def record(self: Any, label: str = "", seconds: float = 0.0, step: float = 0.0) -> str:
    """Log a start event, optionally sleep, log a stop event and one entry in the run log.

    With ``step``, the sleep is taken in steps of about that long: like real
    work, it then progresses only while the process runs, and a process
    frozen mid-way resumes with work left (one long sleep would end at once).
    """
    client = _client()
    execution = scheduler.current_execution()
    execution_id, attempt = (execution.pk, execution.attempt) if execution else (None, None)
    _event(client, EVENTS_KEY, event="start", label=label, execution_id=execution_id, attempt=attempt)
    steps = max(1, round(seconds / step)) if step else 1
    for _ in range(steps if seconds else 0):
        time.sleep(seconds / steps)
    _event(client, EVENTS_KEY, event="stop", label=label, execution_id=execution_id, attempt=attempt)
    client.rpush(RUNS_KEY, json.dumps({"task_id": self.request.id, "label": label, "execution_id": execution_id}))
    client.close()
    return label


#: Redis list of ``{"step": n, "execution_id": id, "attempt": a, "pid": p, "at": t}`` entries from ``tests.steps``.
STEPS_KEY = "tests:steps"


@shared_task(name="tests.steps")
def steps(count: int, seconds: float = 0.2) -> int:
    """Work in ``count`` small steps of ``seconds`` each, logging every finished step."""
    client = _client()
    execution = scheduler.current_execution()
    execution_id, attempt = (execution.pk, execution.attempt) if execution else (None, None)
    for step in range(1, count + 1):
        time.sleep(seconds)
        _event(client, STEPS_KEY, step=step, execution_id=execution_id, attempt=attempt)
    client.close()
    return count


@shared_task(name="tests.stubborn")
def stubborn(seconds: float) -> None:
    """Sleep through the soft time limit, so only the hard limit can stop it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except SoftTimeLimitExceeded:
            pass


@shared_task(name="tests.flaky")
def flaky(key: str, failures: int, hold: int = 0) -> int:
    """Fail the first ``failures`` calls for ``key``, then succeed; log each attempt.

    The first ``hold`` calls wait for ``GO_KEY`` first (logging "holding" in
    ``FENCED_KEY``), so a test can stop the broker or kill the pool child
    while the body runs.
    """
    client = _client()
    _event(client, f"tests:attempts:{key}")
    calls = client.incr(f"tests:calls:{key}")
    if calls <= hold:
        _hold(client, label=key, call=calls)
    client.close()
    if calls <= failures:
        raise RuntimeError(f"planned failure {calls} of {failures}")
    return calls


@task_failure.connect
def _note_stubborn_failure(sender: Any = None, task_id: str = "", **_: Any) -> None:
    """What Celery tells ``task_failure`` receivers and errbacks about ``tests.stubborn``, which tests can read back."""
    if getattr(sender, "name", "") == "tests.stubborn":
        client = _client()
        _event(client, FAILURES_KEY, task_id=task_id)
        client.close()


@shared_task(name="tests.fail")
def fail(message: str = "planned failure") -> None:
    """Always raise."""
    raise RuntimeError(message)


@shared_task(name="tests.fenced_invoice")
def fenced_invoice(hold: str = "", hold_attempt: int = 1) -> str:
    """Insert one side-effect row under ``scheduler.fenced()``, the invoice of this execution.

    Attempt ``hold_attempt`` waits for ``GO_KEY`` at ``hold``: "before" the
    block, or "inside" it after its INSERT (the transaction open).
    """
    client = _client()
    running = scheduler.current_execution()
    fields = {"execution_id": running.pk, "attempt": running.attempt}
    holds = hold if running.attempt == hold_attempt else ""
    try:
        if holds == "before":
            _hold(client, **fields)
        with scheduler.fenced():
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {SIDE_EFFECT_TABLE} (execution_id, attempt, pid) VALUES (%s, %s, %s)",
                    [running.pk, running.attempt, os.getpid()],
                )
            if holds == "inside":
                _hold(client, **fields)
    except ClaimLost:
        _event(client, FENCED_KEY, event="claim lost", **fields)
        raise
    except Error:
        # PostgreSQL ended the session, idle inside the block's transaction for too long: it rolled back.
        _event(client, FENCED_KEY, event="session ended", **fields)
        raise
    _event(client, FENCED_KEY, event="committed", **fields)
    return "invoiced"


def _hold(client: redis.Redis, **fields: Any) -> None:
    _event(client, FENCED_KEY, event="holding", **fields)
    deadline = time.monotonic() + WAIT_SECONDS
    while not client.exists(GO_KEY) and time.monotonic() < deadline:
        time.sleep(0.05)


@shared_task(name="tests.checkpointed")
def checkpointed(items: int, pause_after: int = 0) -> int:
    """Process items 1..``items`` from the last checkpoint on: log each, then checkpoint it.

    Attempt 1 pauses after checkpointing item ``pause_after`` (logs a
    "paused" event and sleeps), so a test can kill it there.
    """
    client = _client()
    running = scheduler.current_execution()
    done = (running.last_checkpoint or {}).get("done", 0)
    for item in range(done + 1, items + 1):
        client.rpush(ITEMS_KEY, json.dumps({"item": item, "attempt": running.attempt, "pid": os.getpid()}))
        running.checkpoint({"done": item})
        if running.attempt == 1 and item == pause_after:
            _event(client, EVENTS_KEY, event="paused", item=item)
            time.sleep(WAIT_SECONDS)
    client.close()
    return items


#: Redis key prefix ``tests.fail_once`` marks an execution with once one of its bodies raised.
FAILED_ONCE_KEY = "tests:failed-once:"


@shared_task(name="tests.fail_once")
def fail_once(label: str = "", seconds: float = 0.0, step: float = 0.1) -> str:
    """Raise in the first body of each execution that gets ``seconds`` in; return in every later one.

    Logs "start", then "raise" or "stop", in ``EVENTS_KEY`` as ``tests.record``
    does. A body stopped before it raises (its process killed) leaves the
    raising to the next attempt: each execution raises exactly once, so a
    schedule with ``max_retries=1`` ends ``succeeded`` unless a retry was lost
    or counted twice.
    """
    client = _client()
    running = scheduler.current_execution()
    fields = {"label": label, "execution_id": running.pk, "attempt": running.attempt}
    _event(client, EVENTS_KEY, event="start", **fields)
    if not client.exists(FAILED_ONCE_KEY + str(running.pk)):
        for _ in range(max(1, round(seconds / step)) if seconds else 0):
            time.sleep(step)
        if client.set(FAILED_ONCE_KEY + str(running.pk), running.attempt, nx=True):
            _event(client, EVENTS_KEY, event="raise", **fields)
            client.close()
            raise RuntimeError(f"planned failure of execution {running.pk} attempt {running.attempt}")
    _event(client, EVENTS_KEY, event="stop", **fields)
    client.close()
    return label


@shared_task(name="tests.checkpoint_in_transaction")
def checkpoint_in_transaction(label: str = "", checkpoints: int = 2) -> int:
    """Save ``checkpoints`` checkpoints inside one ``transaction.atomic()`` of the body's own.

    From the second on, the execution's row is locked by the body's open
    transaction. Logs "start" and "stop" in ``EVENTS_KEY`` as ``tests.record`` does.
    """
    client = _client()
    running = scheduler.current_execution()
    fields = {"label": label, "execution_id": running.pk, "attempt": running.attempt}
    _event(client, EVENTS_KEY, event="start", **fields)
    with transaction.atomic():
        for n in range(1, checkpoints + 1):
            running.checkpoint({"done": n})
    _event(client, EVENTS_KEY, event="stop", **fields)
    client.close()
    return checkpoints


@shared_task(name="tests.connection_uses")
def connection_uses() -> int:
    """Return how many tasks have used this task's database connection, this one included.

    A temporary table lives as long as its connection: a fresh connection counts 1.
    """
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE IF NOT EXISTS test_connection_uses (n integer)")
        cursor.execute("INSERT INTO test_connection_uses VALUES (1)")
        cursor.execute("SELECT count(*) FROM test_connection_uses")
        return cursor.fetchone()[0]


def side_effects() -> list[tuple[int, int, int]]:
    """Return the committed rows of ``SIDE_EFFECT_TABLE``: (execution_id, attempt, pid)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT execution_id, attempt, pid FROM {SIDE_EFFECT_TABLE} ORDER BY attempt")
        return [tuple(row) for row in cursor.fetchall()]


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    """Return the side-effect log, oldest first."""
    return [json.loads(item) for item in client.lrange(RUNS_KEY, 0, -1)]


def events(client: redis.Redis, key: str = EVENTS_KEY) -> list[dict[str, Any]]:
    """Return an event log, oldest first."""
    return [json.loads(item) for item in client.lrange(key, 0, -1)]


#: Redis list of what ``tests.long_transaction`` and ``tests.freeze_holding`` did, with the attempt.
HOLDING_KEY = "tests:holding"
#: Redis key the first ``tests.freeze_holding`` body sets: the later ones do not freeze.
FROZE_KEY = "tests:froze"


@shared_task(name="tests.long_transaction")
def long_transaction(seconds: float, step: float = 0.2) -> int:
    """Hold one write transaction open for ``seconds``: a checkpoint first, then a statement every ``step``.

    The session is never idle inside the transaction for long (on
    PostgreSQL it runs ``pg_sleep``), like a long batch that keeps
    writing. Logs "started" and "committed" in ``HOLDING_KEY``; returns the attempt.
    """
    client = _client()
    running = scheduler.current_execution()
    fields = {"execution_id": running.pk, "attempt": running.attempt}
    _event(client, HOLDING_KEY, event="started", **fields)
    with transaction.atomic():
        running.checkpoint({"holding": seconds})
        deadline = time.monotonic() + seconds
        with connection.cursor() as cursor:
            while (left := deadline - time.monotonic()) > 0:
                if connection.vendor == "postgresql":
                    cursor.execute("SELECT pg_sleep(%s)", [min(step, left)])
                else:
                    time.sleep(min(step, left))
                    cursor.execute("SELECT 1")
    _event(client, HOLDING_KEY, event="committed", **fields)
    client.close()
    return running.attempt


@shared_task(name="tests.freeze_holding")
def freeze_holding(where: str) -> str:
    """The first run stops its whole pool process (SIGSTOP to itself) while it holds rows locked; later runs return.

    ``where`` is "checkpoint": inside the body's own ``atomic()`` right after
    a ``checkpoint()`` (its execution row locked); "fenced": as its
    ``fenced()`` block records the outcome; "outcome": as the guard records
    the outcome of the body that returned (both: the schedule and execution
    rows locked, and whatever the outcome's trigger writes). It logs
    "frozen" in ``HOLDING_KEY`` first, with its pid and its PostgreSQL
    session's backend pid. The test sends SIGCONT.
    """
    client = _client()
    running = scheduler.current_execution()
    fields = {"execution_id": running.pk, "attempt": running.attempt}
    if not client.set(FROZE_KEY, os.getpid(), nx=True):
        return "ran"
    if where == "checkpoint":
        with transaction.atomic():
            running.checkpoint({"frozen": True})
            _freeze(client, **fields)
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        return "ran"
    _freeze_once_counted(client, **fields)
    if where == "fenced":
        with scheduler.fenced():
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
    return "ran"


@task_postrun.connect
def _note_freeze_holding_ended(sender: Any = None, **_: Any) -> None:
    """Log "ended" in ``HOLDING_KEY``, with the pid, once a ``tests.freeze_holding`` run is over, the guard's work too."""
    if getattr(sender, "name", "") == "tests.freeze_holding":
        client = _client()
        _event(client, HOLDING_KEY, event="ended")
        client.close()


def _freeze(client: redis.Redis, **fields: Any) -> None:
    backend_pid = connection.connection.info.backend_pid if connection.vendor == "postgresql" else None
    _event(client, HOLDING_KEY, event="frozen", backend_pid=backend_pid, **fields)
    os.kill(os.getpid(), signal.SIGSTOP)


def _freeze_once_counted(client: redis.Redis, **fields: Any) -> None:
    """Stop this process right after the next outcome is counted on its schedule, its transaction still open."""
    from scheduler.owners import schedules

    count_run = schedules.count_run

    def counted(*args: Any, **kwargs: Any) -> None:
        schedules.count_run = count_run
        count_run(*args, **kwargs)
        _freeze(client, **fields)

    schedules.count_run = counted


@shared_task(name="tests.interrupted_in_transaction", guarded=False)
def interrupted_in_transaction(schedule_id: int) -> None:
    """Leave this process's connection in a transaction Django does not know about, holding a lock.

    The state a soft time limit leaves when it strikes inside Django's
    transaction bookkeeping (after ``BEGIN``, before Django noted the block):
    on SQLite the write lock, on PostgreSQL the schedule row's lock, in a
    transaction nothing will end. Unguarded, so nothing of the guard's
    touches the connection after it.
    """
    connection.ensure_connection()
    raw = connection.connection
    if connection.vendor == "sqlite":
        raw.execute("BEGIN IMMEDIATE")
    else:
        raw.autocommit = False
    placeholder = "?" if connection.vendor == "sqlite" else "%s"  # the drivers' own, not Django's
    raw.execute(f"UPDATE scheduler_schedule SET total_runs = total_runs WHERE id = {placeholder}", [schedule_id])
    _client().rpush(LEFT_OPEN_KEY, os.getpid())


#: Redis list ``tests.interrupted_in_transaction`` appends its pid to once it left its transaction open.
LEFT_OPEN_KEY = "tests:left-open"


@shared_task(name="tests.limited")
def limited(customer: int, steps: int = 5, seconds: float = 0.1, until_go: bool = False) -> int:
    """Work in ``steps`` steps (``until_go``: until ``GO_KEY`` is set), keeping each step's start and end in its checkpoint.

    ``checkpoint()`` saves only while this attempt holds the execution, so the
    record is of steps run under a claim: what a concurrency limit bounds.
    """
    running = scheduler.current_execution()
    spans = list(running.last_checkpoint or [])
    client = _client()
    deadline = time.monotonic() + WAIT_SECONDS
    while until_go and not client.exists(GO_KEY) and time.monotonic() < deadline:
        started = time.time()
        time.sleep(seconds)
        spans.append([started, time.time()])
        running.checkpoint(spans)
    client.close()
    for _ in range(steps):
        started = time.time()
        time.sleep(seconds)
        spans.append([started, time.time()])
        running.checkpoint(spans)
    return customer

"""/metrics built for alerting: counters that only grow, lag of scheduled slots only, durations, queue depth."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import Client

import tests.support.tasks  # noqa: F401 -- registers tests.record with the Celery app
from scheduler import dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Execution, Lease, Schedule, tally
from scheduler.models.tally import TallyIncrement
from scheduler.ops import backfill, prune
from scheduler.owners import executions, leases, schedules
from tests.integration.test_health_metrics import _serve
from tests.support import processes
from tests.support.schema_migrations import migrate_to, migrate_to_newest
from tests.support.threads import on_own_connection

pytestmark = pytest.mark.django_db

Status = Execution.Status
SAMPLE = re.compile(r"^(scheduler_\w+)(\{[^}]*\})? (\S+)$", re.MULTILINE)


def scrape(client: Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {name + (labels or ""): float(value) for name, labels, value in SAMPLE.findall(response.content.decode())}


def counters(samples: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in samples.items() if key.startswith("scheduler_executions_total{")}


def total(samples: dict[str, float], status: str, task: str = "tests.record", trigger: str = "scheduled") -> float:
    return samples.get(f'scheduler_executions_total{{status="{status}",task="{task}",trigger="{trigger}"}}', 0.0)


def running(schedule: Schedule | None = None, key: str = "k", task: str = "tests.record") -> executions.Claim:
    """Record an execution and claim it as a worker would; return the claim."""
    execution, _ = executions.record_one(
        Execution(
            idempotency_key=key,
            task=task,
            schedule=schedule,
            scheduled_for=dbclock.now(),
            status=Status.PENDING,
            celery_task_id=f"c-{key}",
        )
    )
    claimed = executions.claim(worker="w:1", task=task, celery_task_id=f"c-{key}", execution_id=execution.pk)
    assert claimed is not None
    return executions.Claim.of(claimed)


def test_executions_total__each_final_move_counts_once_whatever_the_path() -> None:
    # Given a schedule and nothing counted yet
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    now = dbclock.now()
    # When executions end through each path: finish, cancel in bulk, inserted final (twice), lost then failed
    assert executions.finish(running(schedule, "a"), status=Status.SUCCEEDED)
    assert not executions.finish(executions.Claim(execution_id=0, attempt=1), status=Status.SUCCEEDED)
    for key in ("b", "c"):
        executions.record_one(Execution(idempotency_key=key, task="tests.record", schedule=schedule, scheduled_for=now))
    executions.cancel_in_flight([schedule.pk], reason="test", now=now)
    missed = executions.execution_for(schedule, now - timedelta(hours=1), status=Status.MISSED, now=now)
    executions.insert([missed])
    executions.insert([executions.execution_for(schedule, now - timedelta(hours=1), status=Status.MISSED, now=now)])
    lost = running(schedule, "d")
    Execution.objects.filter(pk=lost.execution_id).update(claim_expires_at=now - timedelta(minutes=1))
    assert executions.mark_lost([lost.execution_id]) == 1
    assert executions.fail_lost(Execution.objects.get(pk=lost.execution_id), reason="gone")
    # And a claim takeover and a retry, which are not final
    retried = running(schedule, "e")
    assert executions.retry(retried, delay_seconds=0)
    # Then each final status counted once per execution that reached it
    tallies = {(status, trigger): count for (status, _, trigger), count in tally.execution_counts().items()}
    assert tallies == {
        ("succeeded", "scheduled"): 1,
        ("cancelled", "scheduled"): 2,
        ("missed", "scheduled"): 1,
        ("failed", "scheduled"): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_executions_total__only_increase_across_a_prune_and_a_web_restart(redis_url: str) -> None:
    # Given finished executions, counted by a web process
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    for key in ("a", "b", "c"):
        assert executions.finish(running(schedule, key), status=Status.SUCCEEDED)
    assert executions.finish(running(schedule, "f"), status=Status.FAILED, error="boom")
    first = counters(_scrape_process(redis_url))
    assert total(first, "succeeded") == 3 and total(first, "failed") == 1
    # When every execution is pruned, one more succeeds, and another web process answers the next scrape
    deleted = prune.prune_executions(older_than=dbclock.now() + timedelta(days=1)).deleted
    assert deleted == 4 and not Execution.objects.exists()
    assert executions.finish(running(schedule, "g"), status=Status.SUCCEEDED)
    second = counters(_scrape_process(redis_url))
    # Then no counter went down, and the new success is counted on top
    assert set(first) <= set(second)
    assert all(second[key] >= value for key, value in first.items()), (first, second)
    assert total(second, "succeeded") == 4 and total(second, "failed") == 1


def _scrape_process(redis_url: str) -> dict[str, float]:
    """Start a web process, scrape /metrics once through HTTP, stop it."""
    server, port = _serve({"REDIS_URL": redis_url})
    try:
        assert processes.wait_until(lambda: _fetch(port) is not None, timeout=20), "the web process never answered"
        text = _fetch(port)
    finally:
        server.terminate()
        server.wait(10)
    assert text is not None
    return {name + (labels or ""): float(value) for name, labels, value in SAMPLE.findall(text)}


def _fetch(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:
        return None


def test_dispatch_lag__twenty_backfilled_slots_leave_the_histogram_unchanged(client: Client, redis_url: str) -> None:
    # Given scheduled slots sent lately, with lags of 0.02 s, 0.3 s and 4 s
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    now = dbclock.now()
    for n, lag in enumerate((0.02, 0.3, 4.0)):
        slot = now - timedelta(seconds=30 + n)
        execution = executions.execution_for(schedule, slot, status=Status.PENDING, now=now)
        execution.save()
        executions.mark_queued([execution.pk], now=slot + timedelta(seconds=lag))
    before = scrape(client)
    lag_before = {key: value for key, value in before.items() if key.startswith("scheduler_dispatch_lag_seconds")}
    assert lag_before['scheduler_dispatch_lag_seconds_bucket{le="+Inf"}'] == 3
    # When 20 past slots are backfilled (recorded and sent now, hours after their slot)
    start = (now - timedelta(minutes=80)).replace(second=0, microsecond=0)
    report = backfill.backfill(schedule, start=start, end=start + timedelta(minutes=19), now=now)
    assert report.created == 20 and report.published == 20
    assert Execution.objects.filter(trigger=Execution.Trigger.BACKFILL, status=Status.QUEUED).count() == 20
    after = scrape(client)
    # Then the lag histogram is the same sample by sample
    assert {
        key: value for key, value in after.items() if key.startswith("scheduler_dispatch_lag_seconds")
    } == lag_before


def test_task_duration__histogram_of_run_time_per_task(client: Client) -> None:
    # Given two runs of 2 s and one of 40 s, finished
    for key, seconds in (("a", 2), ("b", 2), ("c", 40)):
        held = running(key=key)
        Execution.objects.filter(pk=held.execution_id).update(started_at=dbclock.now() - timedelta(seconds=seconds))
        assert executions.finish(held, status=Status.SUCCEEDED)
    samples = scrape(client)
    bucket = 'scheduler_task_duration_seconds_bucket{{le="{}",task="tests.record"}}'
    # Then the buckets are cumulative, with the count and the sum of run times
    assert samples[bucket.format("1.0")] == 0
    assert samples[bucket.format("5.0")] == 2
    assert samples[bucket.format("30.0")] == 2
    assert samples[bucket.format("60.0")] == 3
    assert samples[bucket.format("+Inf")] == 3
    assert samples['scheduler_task_duration_seconds_count{task="tests.record"}'] == 3
    # (SQLite's trigger takes the difference of two julianday() doubles: a few
    # tens of microseconds either way when a run lasts its whole seconds exactly)
    assert 43.999 <= samples['scheduler_task_duration_seconds_sum{task="tests.record"}'] < 46


def test_executions_current_and_leader_present(client: Client) -> None:
    # Given nobody holds the lease, and executions pending, queued and running on two queues
    assert scrape(client)[f'scheduler_leader_present{{lease="{scheduler_settings.LEASE_NAME}"}}'] == 0
    now = dbclock.now()
    for n, (status, queue) in enumerate(
        [(Status.PENDING, ""), (Status.QUEUED, "reports"), (Status.QUEUED, "reports"), (Status.SUCCEEDED, "reports")]
    ):
        Execution.objects.create(idempotency_key=f"k{n}", task="t", queue=queue, scheduled_for=now, status=status)
    running(key="r")
    handle = leases.acquire(scheduler_settings.LEASE_NAME, "host-1", ttl=10)
    assert handle is not None
    samples = scrape(client)
    # Then the waiting and running ones are counted by queue, and the lease is held
    current = {key: value for key, value in samples.items() if key.startswith("scheduler_executions_current")}
    assert current == {
        'scheduler_executions_current{queue="",status="pending"}': 1,
        'scheduler_executions_current{queue="reports",status="queued"}': 2,
        'scheduler_executions_current{queue="",status="running"}': 1,
    }
    assert samples[f'scheduler_leader_present{{lease="{scheduler_settings.LEASE_NAME}"}}'] == 1
    # When the lease expires, Then nobody is present
    Lease.objects.filter(name=handle.name).update(expires_at=Now() - timedelta(seconds=1))
    assert scrape(client)[f'scheduler_leader_present{{lease="{scheduler_settings.LEASE_NAME}"}}'] == 0


@pytest.mark.django_db(transaction=True)
def test_executions_total__never_decreases_while_folds_and_final_moves_run_at_once() -> None:
    # Given a schedule, and a folder, a writer of final rows and a reader, each on its own connection
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    now = dbclock.now()
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []
    written: list[int] = []

    def missed() -> int:
        return tally.execution_counts().get(("missed", "tests.record", "scheduled"), 0)

    def folder() -> None:
        while not stop.is_set():
            tally.fold(batch=7)
            time.sleep(0.002)

    def writer() -> None:
        for round_ in range(60):
            rows = [
                executions.execution_for(
                    schedule, now - timedelta(minutes=round_ * 5 + n), status=Status.MISSED, now=now
                )
                for n in range(5)
            ]
            written.append(len(executions.insert(rows)))

    def reader() -> None:
        while not stop.is_set():
            seen.append(missed())

    def own_connection(body: Callable[[], None]) -> threading.Thread:
        return threading.Thread(target=on_own_connection(body, errors))

    # When they all run at once until the writer is done
    threads = [own_connection(body) for body in (folder, reader)]
    for thread in threads:
        thread.start()
    write = own_connection(writer)
    write.start()
    write.join(timeout=60)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in (*threads, write)), "a thread is stuck"
    assert not errors, errors

    # Then every read saw the count grow or stay, never fall, and the end count is exact
    assert seen and all(later >= earlier for earlier, later in zip(seen, seen[1:])), seen
    assert sum(written) == 300 == missed()
    tally.fold()
    assert not TallyIncrement.objects.exists() and missed() == 300


@pytest.mark.django_db(transaction=True)
def test_migration_0019__counts_survive_both_directions() -> None:
    # Given one missed execution folded into the totals and one still an increment
    schedule = schedules.create(name="s", task="tests.record", interval=60)
    now = dbclock.now()

    def miss(minutes: int) -> None:
        executions.insert(
            [executions.execution_for(schedule, now - timedelta(minutes=minutes), status=Status.MISSED, now=now)]
        )

    miss(1)
    tally.fold()
    miss(2)
    try:
        # When the migration is undone, Then the totals hold both and the old trigger counts the next
        old = migrate_to([("scheduler", "0018_schedule_pruned_through")])
        # the row as that release wrote it: its model has none of the later columns
        old.get_model("scheduler", "Execution").objects.create(
            idempotency_key=f"missed-3-{schedule.pk}",
            schedule_id=schedule.pk,
            task="tests.record",
            scheduled_for=now - timedelta(minutes=3),
            status=Status.MISSED,
        )
        with connection.cursor() as cursor:
            cursor.execute("SELECT SUM(count) FROM scheduler_executiontally WHERE status = 'missed'")
            assert cursor.fetchone()[0] == 3
    finally:
        # When it is applied again, Then the next one is an increment and every count is there
        migrate_to_newest()
    miss(4)
    assert TallyIncrement.objects.count() == 1
    assert tally.execution_counts()[("missed", "tests.record", "scheduled")] == 4

"""Real workers under the execution guard: each execution runs once, within its limits."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.db import close_old_connections, connection
from django_celery_results.models import TaskResult

import scheduler
from project.celery import app
from scheduler import dbclock, outbox
from scheduler.models import Execution, Instance, Schedule
from scheduler.owners import executions, schedules
from tests.support import tasks as test_tasks
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]
FINAL = tuple(Execution.FINAL_STATUSES)


def wait_final(execution: Execution, *, timeout: float = 30.0) -> Execution:
    """Wait until ``execution`` reaches a final status; return it fresh from the database."""
    done = wait_until(
        lambda: Execution.objects.filter(pk=execution.pk, status__in=FINAL).first(), timeout=timeout, interval=0.1
    )
    if not done:
        execution.refresh_from_db()
        raise AssertionError(f"execution {execution.pk} still {execution.status} after {timeout}s")
    return done  # type: ignore[return-value]


def publish_again(execution: Execution, *, queue: str | None = None) -> None:
    """Send another message for ``execution``, as a broker redelivery or a re-publish would."""
    row = executions.message_row(execution)
    if queue is not None:
        row["queue"] = queue
    outbox.publish(app, [row], now=dbclock.now())


def worker_pid(execution: Execution) -> int:
    """Return the pid of the pool process that claimed ``execution`` (``worker`` is ``name@host:pid``)."""
    return int(Execution.objects.get(pk=execution.pk).worker.rsplit(":", 1)[1])


def duplicates_logged(*workers: CeleryProcess) -> int:
    return sum(worker.log().count("duplicate delivery of execution") for worker in workers)


def holding(client: redis.Redis) -> bool:
    """Whether a ``tests.flaky`` body is holding, waiting for ``GO_KEY``."""
    return any(event["event"] == "holding" for event in test_tasks.events(client, test_tasks.FENCED_KEY))


def test_execution_published_three_times__runs_once(celery_processes: Start, redis_client: redis.Redis) -> None:
    # Given a worker with two pool processes and an execution that takes a moment
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.record", kwargs={"label": "thrice", "seconds": 0.5})
    # When the same execution is sent twice more while the first copy runs
    publish_again(execution)
    publish_again(execution)
    # Then it ran once, both extra copies were refused and logged
    done = wait_final(execution)
    assert wait_until(lambda: duplicates_logged(worker) == 2, timeout=10), worker.log()[-3000:]
    # (and the worker keeps a heartbeat row in the instance registry)
    assert Instance.objects.filter(role=Instance.Role.WORKER).exists()
    assert done.status == Execution.Status.SUCCEEDED
    assert [run["execution_id"] for run in test_tasks.runs(redis_client)] == [execution.pk]
    assert done.result == "thrice"
    assert done.started_at <= done.finished_at
    # And the django-celery-results row for the same Celery task is reachable
    assert wait_until(lambda: done.task_result, timeout=10)
    assert done.task_result.status == "SUCCESS"


def test_execution_delivered_to_two_workers_at_once__runs_once(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given two workers consuming the same queue
    workers = [celery_processes("worker", f"w{n}") for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.record", kwargs={"label": "race", "seconds": 1.0})
    # When five more copies go out at once, so both workers get some
    for _ in range(5):
        publish_again(execution)
    # Then one body ran; every other copy was refused as a duplicate
    assert wait_final(execution).status == Execution.Status.SUCCEEDED
    assert wait_until(lambda: duplicates_logged(*workers) == 5, timeout=10), [w.log()[-2000:] for w in workers]
    assert len(test_tasks.runs(redis_client)) == 1
    assert all(worker.log().count("tests.record[") for worker in workers), "one worker never received a copy"


def test_plain_celery_call__recorded_as_ad_hoc_execution(celery_processes: Start, redis_client: redis.Redis) -> None:
    # Given a worker
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When a task is sent the plain Celery way, and its message delivered twice
    result = app.send_task("tests.record", kwargs={"label": "plain"})
    app.send_task("tests.record", kwargs={"label": "plain"}, task_id=result.id)
    # Then one ad-hoc Execution keyed by the Celery task id ran once
    execution = wait_until(
        lambda: Execution.objects.filter(idempotency_key=f"celery:{result.id}", status__in=FINAL).first(), timeout=20
    )
    assert execution, worker.log()[-3000:]
    assert execution.status == Execution.Status.SUCCEEDED
    assert execution.schedule is None and execution.task == "tests.record" and execution.celery_task_id == result.id
    assert wait_until(lambda: duplicates_logged(worker) == 1, timeout=10)
    assert [run["execution_id"] for run in test_tasks.runs(redis_client)] == [execution.pk]


def test_success__celery_result_row_is_written_by_the_outcome_statement(
    celery_processes: Start, db_vendor: str
) -> None:
    # Given a worker
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")

    # When a guarded task sent the plain Celery way succeeds
    result = app.send_task("tests.record", kwargs={"label": "stored"})

    # Then Celery reads its result back, from the row the outcome wrote: on PostgreSQL the two rows were last
    # written by the same transaction (Celery's own write would be a transaction of its own), and no worker
    # fell back from the fast path
    assert result.get(timeout=20) == "stored", worker.log()[-3000:]
    execution = Execution.objects.get(celery_task_id=result.id)
    assert execution.status == Execution.Status.SUCCEEDED
    if db_vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT xmin::text FROM {Execution._meta.db_table} WHERE id = %s", [execution.pk])
            (outcome,) = cursor.fetchone()
            cursor.execute(f"SELECT xmin::text FROM {TaskResult._meta.db_table} WHERE task_id = %s", [result.id])
            (stored,) = cursor.fetchone()
        assert stored == outcome
    assert "fast path celery_result falls back" not in worker.log()


def test_soft_timeout__recorded_timed_out(celery_processes: Start, redis_client: redis.Redis) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # Given a task that sleeps longer than its timeout
    execution = scheduler.submit("tests.record", kwargs={"label": "slow", "seconds": 10}, timeout=1)
    # Then the soft limit stops it and the reason is stored
    done = wait_final(execution, timeout=20)
    assert done.status == Execution.Status.TIMED_OUT
    assert "Soft time limit of 1s exceeded" in done.error
    assert "SoftTimeLimitExceeded" in done.traceback
    assert test_tasks.runs(redis_client) == []


def test_hard_timeout__kills_the_child_and_is_recorded_timed_out(celery_processes: Start, settings: Any) -> None:
    settings.SCHEDULER_TIMEOUT_GRACE_SECONDS = 1.0
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # Given a task that ignores its soft time limit
    execution = scheduler.submit("tests.stubborn", args=[30], timeout=1)
    # Then the hard limit (timeout + grace) kills it and the reason is stored
    done = wait_final(execution, timeout=20)
    assert done.status == Execution.Status.TIMED_OUT
    assert "Hard time limit of 2.0s exceeded" in done.error
    worker.wait_for_log(r"Hard time limit \(2\.0s\) exceeded")


def test_no_timeout__runs_past_any_default_limit(celery_processes: Start, settings: Any) -> None:
    settings.SCHEDULER_TIMEOUT_GRACE_SECONDS = 0.5
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.stubborn", args=[3])
    assert wait_final(execution, timeout=20).status == Execution.Status.SUCCEEDED
    assert "time limit" not in worker.log().lower()


def test_worker_killed_mid_task__claimable_after_its_claim_expires_and_never_concurrent(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    claim = {"claim_seconds": 3, "claim_renew_seconds": 0.5}
    # Given worker A running a long execution, and worker B on another queue
    worker_a = celery_processes("worker", "a", queues="a", **claim)
    worker_b = celery_processes("worker", "b", queues="b", **claim)
    for worker in (worker_a, worker_b):
        worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.record", kwargs={"label": "long", "seconds": 6}, queue="a", max_retries=1)
    assert wait_until(lambda: test_tasks.events(redis_client), timeout=20), worker_a.log()[-3000:]
    # The running execution's claim is renewed in the background
    first_expiry = Execution.objects.get(pk=execution.pk).claim_expires_at
    assert wait_until(lambda: Execution.objects.get(pk=execution.pk).claim_expires_at > first_expiry, timeout=5)

    # When A is killed outright and the execution is re-sent to B at once
    pid_a = worker_pid(execution)
    worker_a.kill_group(signal.SIGKILL)
    publish_again(execution, queue="b")
    # Then B refuses it while A's claim is still live
    assert wait_until(lambda: duplicates_logged(worker_b) == 1, timeout=10), worker_b.log()[-3000:]
    assert Execution.objects.get(pk=execution.pk).status == Execution.Status.RUNNING

    # When the claim has expired (database clock) and it is re-sent again
    assert wait_until(lambda: Execution.objects.claimable().filter(pk=execution.pk).exists(), timeout=10), (
        "the dead worker's claim never expired"
    )
    publish_again(execution, queue="b")
    # Then B runs it to completion as attempt 2
    done = wait_final(execution, timeout=20)
    assert (done.status, done.attempt) == (Execution.Status.SUCCEEDED, 2)
    assert done.worker.startswith("b@")
    pid_b = worker_pid(done)
    # And the body never ran twice at the same time: A's child started and never
    # stopped (it died), B's started only after that
    events = test_tasks.events(redis_client)
    assert [(e["event"], e["pid"]) for e in events] == [("start", pid_a), ("start", pid_b), ("stop", pid_b)], events


@pytest.mark.parametrize(
    ("max_retries", "lost_retries", "status", "attempt"),
    [(1, 0, "succeeded", 2), (0, 3, "succeeded", 2), (0, 0, "failed", 2)],
    ids=["a retry left", "a lost-worker re-run left", "none left"],
)
def test_pool_child_killed__requeued_and_claimed_again_at_once_or_failed_without_retries(
    celery_processes: Start, redis_client: redis.Redis, max_retries: int, lost_retries: int, status: str, attempt: int
) -> None:
    # Given a worker whose claims last far longer than this test
    worker = celery_processes("worker", "w1", claim_seconds=600, lost_retries=lost_retries)
    worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.record", kwargs={"label": "oom", "seconds": 3}, max_retries=max_retries)
    assert wait_until(lambda: test_tasks.events(redis_client), timeout=20), worker.log()[-3000:]
    # When only the pool child running it dies (as with the kernel's OOM killer)
    os.kill(worker_pid(execution), signal.SIGKILL)
    # Then the worker releases the claim and the requeued message
    # claims it at once: run again if a retry is left, else failed with the reason
    done = wait_final(execution, timeout=30)
    assert (done.status, done.attempt) == (status, attempt), worker.log()[-3000:]
    if status == "failed":
        assert done.error == "Worker lost during attempt 1; no retries left"
        assert len(test_tasks.runs(redis_client)) == 0
    else:
        assert len(test_tasks.runs(redis_client)) == 1


def test_pool_child_killed_then_the_body_fails__the_error_still_has_its_retry(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given a worker that runs lost attempts again only within max_retries, and
    # an execution with one retry whose body fails on its second call
    worker = celery_processes("worker", "w1", claim_seconds=600, lost_retries=0)
    worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.flaky", args=["lost", 2, 1], max_retries=1, retry_backoff=1)
    assert wait_until(lambda: holding(redis_client), timeout=20), worker.log()[-3000:]
    # When the pool child running attempt 1 dies, and attempt 2 raises
    os.kill(worker_pid(execution), signal.SIGKILL)
    # Then the lost attempt used none of the task's retries: attempt 3 runs and succeeds
    done = wait_final(execution, timeout=40)
    assert (done.status, done.attempt, done.result) == (Execution.Status.SUCCEEDED, 3, 3), worker.log()[-3000:]
    assert len(test_tasks.events(redis_client, "tests:attempts:lost")) == 3


def test_retry__fails_twice_then_succeeds_with_growing_delays(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # Given a task that fails twice, with two retries allowed and a 1 s backoff base
    execution = scheduler.submit("tests.flaky", args=["r", 2], max_retries=2, retry_backoff=1)
    # Then the third attempt succeeds
    done = wait_final(execution, timeout=30)
    assert (done.status, done.attempt, done.result) == (Execution.Status.SUCCEEDED, 3, 3)
    attempts = [event["at"] for event in test_tasks.events(redis_client, "tests:attempts:r")]
    assert len(attempts) == 3
    # Each retry waited at least its backoff step (1 s, then 2 s): a lower
    # bound only, since the broker's ETA can never run a message early but a
    # busy machine can always run it late.
    gaps = [later - earlier for earlier, later in zip(attempts, attempts[1:])]
    assert gaps[0] >= 1.0 and gaps[1] >= 2.0, gaps
    assert done.error == ""  # the outcome's error; earlier attempts' errors are not kept


def test_retries_exhausted__failed_with_error_and_traceback(celery_processes: Start) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    execution = scheduler.submit("tests.flaky", args=["x", 5], max_retries=1, retry_backoff=1)
    done = wait_final(execution, timeout=30)
    assert (done.status, done.attempt) == (Execution.Status.FAILED, 2)
    assert done.error == "RuntimeError: planned failure 2 of 5"
    assert "Traceback" in done.traceback


def test_submit_from_sixteen_threads_with_one_key__one_row_one_run(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    barrier = threading.Barrier(16)
    returned: list[int] = []
    errors: list[BaseException] = []

    def submit_once() -> None:
        try:
            barrier.wait(timeout=10)
            returned.append(scheduler.submit("tests.record", kwargs={"label": "once"}, idempotency_key="order-42").pk)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)
        finally:
            close_old_connections() if connection.vendor == "sqlite" else connection.close()

    threads = [threading.Thread(target=submit_once) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert len(returned) == 16 and len(set(returned)) == 1
    assert Execution.objects.filter(idempotency_key="order-42").count() == 1
    assert wait_final(Execution.objects.get(idempotency_key="order-42")).status == Execution.Status.SUCCEEDED
    assert len(test_tasks.runs(redis_client)) == 1
    # And a later call with the key returns the same execution and sends nothing
    assert scheduler.submit("tests.record", idempotency_key="order-42").pk == returned[0]
    assert duplicates_logged(worker) == 0


def test_circuit_breaker__pauses_the_schedule_after_three_failures(celery_processes: Start) -> None:
    # Given a schedule that fails every second and pauses after three failures
    schedule = Schedule(name="breaker", task="tests.fail", interval=1, pause_after_failures=3)
    schedule.full_clean()
    schedules.save(schedule)
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    celery_processes("beat", "beat1")
    # Then it is paused with a reason after the third consecutive failure
    paused = wait_until(lambda: Schedule.objects.filter(pk=schedule.pk).exclude(paused_reason="").first(), timeout=40)
    assert paused, worker.log()[-3000:]
    assert paused.consecutive_failures >= 3  # a run already under way may fail after the pause
    assert paused.next_run_at is None
    assert paused.paused_reason.startswith("Paused after 3 consecutive failures; last: RuntimeError")
    # And the beat dispatches nothing more for it
    settled = wait_until(
        lambda: not Execution.objects.filter(schedule=schedule).exclude(status__in=FINAL).exists(), timeout=20
    )
    assert settled
    count = Execution.objects.filter(schedule=schedule).count()
    failed = Execution.objects.filter(schedule=schedule, status=Execution.Status.FAILED).count()
    assert failed >= 3
    assert not wait_until(lambda: Execution.objects.filter(schedule=schedule).count() > count, timeout=3)


def test_pickled_message__refused_by_the_worker(celery_processes: Start, redis_client: redis.Redis) -> None:
    # Given a worker (JSON only) and a message serialized with pickle, as an attacker with broker access would send
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    test_tasks.publish_record_by_hand("pickled", "pickled-1", serializer="pickle")
    # Then the worker refuses to deserialize it and nothing runs
    worker.wait_for_log(r"untrusted content of type pickle")
    execution = scheduler.submit("tests.record", kwargs={"label": "after"})
    assert wait_final(execution).status == Execution.Status.SUCCEEDED
    assert [run["label"] for run in test_tasks.runs(redis_client)] == ["after"]


def test_plain_celery_call_with_a_nul__runs_and_its_failure_is_recorded(celery_processes: Start) -> None:
    # Given a worker
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")

    # When a plain Celery call carries a NUL (which PostgreSQL stores nowhere) and its body fails with it
    result = app.send_task("tests.fail", kwargs={"message": "bad\x00input"})

    # Then the failure is recorded, each NUL replaced, and Celery's own result row holds it too
    execution = wait_until(
        lambda: Execution.objects.filter(celery_task_id=result.id, status__in=FINAL).first(), timeout=20
    )
    assert execution, worker.log()[-3000:]
    assert (execution.status, execution.kwargs, execution.error) == (
        Execution.Status.FAILED,
        {"message": "bad\ufffdinput"},
        "RuntimeError: bad\ufffdinput",
    )
    assert wait_until(lambda: TaskResult.objects.filter(task_id=result.id, status="FAILURE").exists(), timeout=10), (
        worker.log()[-3000:]
    )


def test_plain_calls_with_odd_soft_time_limits__recorded_in_whole_seconds_and_run(
    celery_processes: Start, redis_client: redis.Redis
) -> None:
    # Given a worker
    worker = celery_processes("worker", "w1")
    worker.wait_for_log(r"ready\.")
    # When plain Celery calls come with a soft time limit of half a second,
    # and one longer than the timeout column holds (about 95 years)
    short = app.send_task("tests.record", kwargs={"label": "short"}, soft_time_limit=0.5)
    endless = app.send_task("tests.record", kwargs={"label": "endless"}, soft_time_limit=3e9)
    # Then both run, recorded with a timeout of a whole second, and none
    assert wait_until(lambda: len(test_tasks.runs(redis_client)) == 2, timeout=20), worker.log()[-3000:]
    recorded = dict(Execution.objects.values_list("celery_task_id", "timeout"))
    assert recorded == {short.id: 1, endless.id: None}


def test_worker_with_a_node_name_no_row_can_hold__refuses_to_start_in_one_line(celery_processes: Start) -> None:
    # Given a node name longer than a claim's and a heartbeat's worker column can hold with a pid
    name = "w" * 250
    # When a worker starts under it
    worker = celery_processes("worker", name)
    # Then it stops at once with one line naming the limit, before any task or heartbeat
    assert wait_until(lambda: not worker.alive(), timeout=20), worker.log()[-3000:]
    assert worker.popen.returncode != 0
    assert "node name" in worker.log() and "at most" in worker.log(), worker.log()[-3000:]
    assert "Traceback" not in worker.log(), worker.log()[-3000:]
    assert not Instance.objects.exists()

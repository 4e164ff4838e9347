"""reconcile() against the real database and broker: each step, the audit, dry runs, two passes at once."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from celery import Celery

from project.celery import app
from scheduler import dbclock
from scheduler.conf import settings as scheduler_settings
from scheduler.models import Execution, Instance, Schedule
from scheduler.ops.reconcile import ReconcileReport, reconcile
from scheduler.owners import executions
from tests.support.factories import make_execution, make_schedule
from tests.support.replicas import BeatReplica
from tests.support.threads import run_at_once

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def lost_counts_against_max_retries(settings: Any) -> None:
    """These tests pin ``max_retries`` for lost attempts: no extra lost-worker re-runs."""
    settings.SCHEDULER_LOST_RETRIES = 0


Status = Execution.Status


def execution(key: str, target: Schedule | None = None, **fields: Any) -> Execution:
    fields.setdefault("scheduled_for", dbclock.now() - timedelta(hours=1))
    fields.setdefault("celery_task_id", f"celery-{key}")
    return make_execution(key, schedule=target, task="scheduler.echo", **fields)


def backdate(row: Execution | Instance | Schedule, **fields: Any) -> None:
    """Write timestamps in the past directly (auto_now_add fields included)."""
    type(row).objects.filter(pk=row.pk).update(**fields)


def running_with_expired_lease(key: str, target: Schedule | None = None, **fields: Any) -> Execution:
    row = execution(key, target, status=Status.RUNNING, worker="dead-host:1", **fields)
    now = dbclock.now()
    backdate(row, started_at=now - timedelta(minutes=5), claim_expires_at=now - timedelta(seconds=1))
    return row


def sent_ids(client: redis.Redis) -> list[int]:
    """Execution ids of the messages waiting in the default queue."""
    return [json.loads(raw)["headers"][Execution.MESSAGE_HEADER] for raw in client.lrange("celery", 0, -1)]


def last_slot(now: datetime) -> datetime:
    """The latest minutely slot at or before ``now`` (UTC)."""
    return now.replace(second=0, microsecond=0)


def kinds(report: ReconcileReport) -> list[tuple[str, int | None]]:
    return [(change.kind, change.execution_id or change.schedule_id) for change in report.changes]


# --- lost executions -----------------------------------------------------------------


def test_lost__attempts_left__retrying_next_attempt_and_sent(redis_client: redis.Redis) -> None:
    # Given a running execution whose worker stopped renewing its lease, with a retry left
    lost = running_with_expired_lease("lost", max_retries=1)
    alive = execution("alive", status=Status.RUNNING)
    backdate(alive, claim_expires_at=dbclock.now() + timedelta(seconds=30))

    # When reconciled
    report = reconcile(now=dbclock.now(), app=app)

    # Then it is retried as attempt 2 and sent; the one still renewing is untouched
    lost.refresh_from_db()
    assert (lost.status, lost.attempt) == (Status.RETRYING, 2)
    assert kinds(report) == [("lost_retrying", lost.pk)]
    assert sent_ids(redis_client) == [lost.pk]
    alive.refresh_from_db()
    assert alive.status == Status.RUNNING


@pytest.mark.parametrize(("attempt", "kind"), [(1, "lost_retrying"), (3, "lost_retrying"), (4, "lost_failed")])
def test_lost__worker_lost_is_run_again_beyond_max_retries_up_to_lost_retries(
    settings: Any, attempt: int, kind: str
) -> None:
    # Given three re-runs allowed for lost workers, and a lost execution with no retries of its own
    settings.SCHEDULER_LOST_RETRIES = 3
    lost = running_with_expired_lease("lost", max_retries=0, attempt=attempt)

    # When reconciled
    report = reconcile(now=dbclock.now(), app=app)

    # Then it runs again until it has lost three workers, then fails with the reason
    assert kinds(report) == [(kind, lost.pk)]


def test_lost__no_attempts_left__failed_and_counted_on_its_schedule() -> None:
    # Given a schedule that pauses after one failure, and its lost execution on its last attempt
    target = make_schedule("s", pause_after_failures=1, max_retries=1)
    lost = running_with_expired_lease("lost", target, max_retries=1, attempt=2)

    # When reconciled
    report = reconcile(now=dbclock.now(), app=app)

    # Then it failed with the reason, and the schedule counted the failure like a worker would
    lost.refresh_from_db()
    assert (lost.status, lost.error) == (Status.FAILED, "Worker lost during attempt 2; no retries left")
    assert lost.finished_at is not None and lost.claim_expires_at is None
    assert kinds(report) == [("lost_failed", lost.pk)]
    target.refresh_from_db()
    assert (target.total_runs, target.consecutive_failures) == (1, 1)
    assert target.last_error == lost.error and "1 consecutive failures" in target.paused_reason


# --- unsent and unclaimed messages -------------------------------------------------


def test_pending__older_than_threshold__sent_and_queued(redis_client: redis.Redis) -> None:
    # Given pending executions: one old, one fresh, one old but held by overlap=buffer_one
    now = dbclock.now()
    old = execution("old", status=Status.PENDING)
    fresh = execution("fresh", status=Status.PENDING)
    held = execution("held", status=Status.PENDING, buffered=True)
    for row in (old, held):
        backdate(row, created_at=now - timedelta(minutes=5))

    # When reconciled
    report = reconcile(now=now, app=app)

    # Then only the old, unheld one was sent and is queued
    assert kinds(report) == [("published", old.pk)]
    assert sent_ids(redis_client) == [old.pk]
    assert Execution.objects.get(pk=old.pk).status == Status.QUEUED
    assert [Execution.objects.get(pk=row.pk).status for row in (fresh, held)] == [Status.PENDING, Status.PENDING]


def test_queued__never_claimed__sent_again_once_per_threshold(redis_client: redis.Redis) -> None:
    # Given a queued execution sent 20 minutes ago and never claimed, and one sent just now
    now = dbclock.now()
    stale = execution("stale", status=Status.QUEUED, enqueued_at=now - timedelta(minutes=20))
    recent = execution("recent", status=Status.QUEUED, enqueued_at=now)

    # When reconciled twice
    first = reconcile(now=now, app=app)
    second = reconcile(now=now, app=app)

    # Then the stale one went out once more, and the clock for the next re-send restarted
    assert kinds(first) == [("republished", stale.pk)]
    assert kinds(second) == []
    assert sent_ids(redis_client) == [stale.pk]
    stale.refresh_from_db()
    assert (stale.status, stale.enqueued_at) == (Status.QUEUED, now)
    assert Execution.objects.get(pk=recent.pk).enqueued_at == now


def test_queued__a_plain_celery_call_recorded_but_never_claimed__sent_again(redis_client: redis.Redis) -> None:
    # Given a plain Celery call (``.delay()``) that a worker recorded as its
    # ad-hoc execution and then died before claiming (the message was lost with it)
    key = executions.record_ad_hoc(
        "plain-1", task="scheduler.echo", args=[], kwargs={}, queue="", timeout=None, now=dbclock.now()
    )
    recorded = Execution.objects.get(idempotency_key=key)
    backdate(recorded, scheduled_for=dbclock.now() - timedelta(hours=1))
    later = dbclock.now() + timedelta(seconds=scheduler_settings.RECONCILE_QUEUED_AFTER_SECONDS + 1)

    # When reconciled once it has waited past the threshold
    report = reconcile(now=later, app=app)

    # Then it is sent again, as any queued execution nobody claimed
    assert kinds(report) == [("republished", recorded.pk)]
    assert sent_ids(redis_client) == [recorded.pk]


def test_queued__without_enqueued_at__sent_again_by_when_it_was_recorded(redis_client: redis.Redis) -> None:
    # Given a queued execution recorded 20 minutes ago without enqueued_at (as
    # plain Celery calls were), and one recorded just now
    now = dbclock.now()
    old = execution("old", status=Status.QUEUED)
    backdate(old, created_at=now - timedelta(minutes=20))
    execution("new", status=Status.QUEUED)

    # When reconciled
    report = reconcile(now=now, app=app)

    # Then the old one went out again, and waits a full threshold for the next re-send
    assert kinds(report) == [("republished", old.pk)]
    assert sent_ids(redis_client) == [old.pk]
    assert Execution.objects.get(pk=old.pk).enqueued_at == now


def test_send__broker_unreachable__reported_and_rows_left_waiting(unreachable_app: Celery) -> None:
    # Given an old pending execution and a broker nobody listens on
    now = dbclock.now()
    old = execution("old", status=Status.PENDING)
    backdate(old, created_at=now - timedelta(minutes=5))

    # When reconciled
    report = reconcile(now=now, app=unreachable_app)

    # Then nothing claims it was sent, the error says why, and the row waits for the next pass
    assert report.publish_error.startswith("broker unreachable")
    assert kinds(report) == []
    assert Execution.objects.get(pk=old.pk).status == Status.PENDING


# --- schedules and instances -------------------------------------------------------


def test_next_run_at__unset_or_not_a_slot__recomputed_and_due_ones_left_alone() -> None:
    # Given three minutely schedules: next_run_at unset, off the minute, and due (a past slot)
    now = dbclock.now()
    unset, off, due = (make_schedule(name) for name in ("unset", "off", "due"))
    backdate(unset, next_run_at=None)
    backdate(off, next_run_at=last_slot(now) + timedelta(seconds=7))
    backdate(due, next_run_at=last_slot(now) - timedelta(minutes=3))

    # When reconciled
    report = reconcile(now=now, app=app)

    # Then the first two point at the next slot after now; the due one still is due
    expected = last_slot(now) + timedelta(minutes=1)
    assert sorted(kinds(report)) == sorted([("next_run_at", unset.pk), ("next_run_at", off.pk)])
    assert [Schedule.objects.get(pk=s.pk).next_run_at for s in (unset, off)] == [expected, expected]
    assert Schedule.objects.get(pk=due.pk).next_run_at == last_slot(now) - timedelta(minutes=3)


def test_instances__silent_too_long__removed() -> None:
    # Given a worker last seen two hours ago and a beat seen just now
    now = dbclock.now()
    common = dict(hostname="h", pid=1, started_at=now - timedelta(hours=3))
    stale = Instance.objects.create(instance_id="h-1-old", role="worker", last_seen=now - timedelta(hours=2), **common)
    Instance.objects.create(instance_id="h-2-new", role="beat", last_seen=now, **common)

    # When reconciled
    report = reconcile(now=now, app=app)

    # Then only the silent one is gone
    assert [change.kind for change in report.changes] == ["instance_removed"]
    assert stale.instance_id in report.changes[0].detail
    assert list(Instance.objects.values_list("instance_id", flat=True)) == ["h-2-new"]


# --- audit ---------------------------------------------------------------------------


def audited(now: datetime, **fields: Any) -> tuple[Schedule, list[datetime]]:
    """A minutely schedule created an hour ago with a 3-minute catch-up window; return it and its 3 audited slots."""
    target = make_schedule("audited", catchup_window=180, **fields)
    last = last_slot(now)
    hour_ago = now - timedelta(hours=1)
    backdate(target, created_at=hour_ago, owed_since=hour_ago, next_run_at=last + timedelta(minutes=1))
    target.refresh_from_db()
    return target, [last - timedelta(minutes=2), last - timedelta(minutes=1), last]


def test_audit__slot_without_execution__reported_and_nothing_written() -> None:
    # Given a schedule whose slots in its window all have executions but one
    now = dbclock.now()
    target, slots = audited(now)
    for slot in (slots[0], slots[2]):
        execution(executions.key(target, slot), target, scheduled_for=slot, status=Status.SUCCEEDED)

    # When reconciled without repair
    report = reconcile(now=now, app=app)

    # Then the missing slot is reported, and not recorded
    assert [(c.kind, c.schedule_id) for c in report.changes] == [("missing_slot", target.pk)]
    assert slots[1].isoformat() in report.changes[0].detail
    assert Execution.objects.count() == 2


@pytest.mark.parametrize(
    ("misfire", "expected"),
    [
        ("run_all", [Status.QUEUED, Status.QUEUED, Status.QUEUED]),
        ("run_once", [Status.MISSED, Status.MISSED, Status.QUEUED]),
        ("skip", [Status.MISSED, Status.MISSED, Status.MISSED]),
    ],
)
def test_audit__repair__records_missing_slots_by_misfire_policy(
    redis_client: redis.Redis, misfire: str, expected: list[str]
) -> None:
    # Given a schedule none of whose 3 slots in its window has an execution
    now = dbclock.now()
    target, slots = audited(now, misfire=misfire)

    # When reconciled with repair, twice
    first = reconcile(now=now, repair=True, app=app)
    second = reconcile(now=now, repair=True, app=app)

    # Then each slot was recorded once under the beat's key, per the policy, the runs sent
    rows = list(Execution.objects.filter(schedule=target).order_by("scheduled_for"))
    assert [row.scheduled_for for row in rows] == slots
    assert [row.idempotency_key for row in rows] == [executions.key(target, slot) for slot in slots]
    assert [row.status for row in rows] == expected
    assert all(row.lease_token is None for row in rows)
    assert sorted(sent_ids(redis_client)) == [row.pk for row in rows if row.status == Status.QUEUED]
    assert [c.kind for c in first.changes] == ["slot_recorded"] * 3 and second.changes == ()
    target.refresh_from_db()
    assert target.total_missed == expected.count(Status.MISSED)


def test_audit__slots_before_owed_since_or_from_next_run_at_on__not_owed() -> None:
    # Given a minutely schedule owing slots from 90 s before its last slot, which is due but not fired yet
    now = dbclock.now()
    target = make_schedule("new", catchup_window=600)
    last = last_slot(now)
    backdate(target, created_at=last - timedelta(seconds=90), owed_since=last - timedelta(seconds=90), next_run_at=last)

    # When reconciled
    report = reconcile(now=now, app=app)

    # Then only the one slot between its owed_since and its next_run_at is missing
    assert [c.detail for c in report.changes] == [
        f"new: slot {(last - timedelta(minutes=1)).isoformat()} has no execution"
    ]


# --- dry run and concurrency -----------------------------------------------------------


def test_dry_run__reports_every_step_and_changes_nothing(redis_client: redis.Redis) -> None:
    # Given something for every step to do
    now = dbclock.now()
    target, _ = audited(now)
    retry = running_with_expired_lease("retry", max_retries=1)
    fail = running_with_expired_lease("fail", target)
    pending = execution("pending", status=Status.PENDING)
    backdate(pending, created_at=now - timedelta(minutes=5))
    queued = execution("queued", status=Status.QUEUED, enqueued_at=now - timedelta(hours=1))
    unset = make_schedule("unset")
    backdate(unset, next_run_at=None)
    Instance.objects.create(
        instance_id="gone", role="worker", hostname="h", pid=1, started_at=now, last_seen=now - timedelta(days=1)
    )
    before = snapshot()

    # When reconciled as a dry run with repair
    report = reconcile(now=now, dry_run=True, repair=True, app=app)

    # Then the report lists what a real pass would do, and nothing changed or was sent
    assert report.counts == {
        "lost_retrying": 1,
        "lost_failed": 1,
        "published": 1,
        "republished": 1,
        "next_run_at": 1,
        "instance_removed": 1,
        "slot_recorded": 3,
    }
    assert {("lost_retrying", retry.pk), ("lost_failed", fail.pk), ("published", pending.pk)} <= set(kinds(report))
    assert ("republished", queued.pk) in kinds(report) and ("next_run_at", unset.pk) in kinds(report)
    assert snapshot() == before
    assert sent_ids(redis_client) == []


def snapshot() -> tuple[list[dict[str, Any]], ...]:
    return tuple(list(model.objects.order_by("pk").values()) for model in (Execution, Schedule, Instance))


def test_two_passes_at_once__each_change_made_once(redis_client: redis.Redis) -> None:
    # Given many lost executions (some with a retry left), a schedule with missing slots,
    # an old pending execution and stale instances
    now = dbclock.now()
    target, slots = audited(now)
    retrying = [running_with_expired_lease(f"r{i}", max_retries=1) for i in range(20)]
    failing = [running_with_expired_lease(f"f{i}", target) for i in range(20)]
    pending = execution("pending", status=Status.PENDING)
    backdate(pending, created_at=now - timedelta(minutes=5))
    for i in range(10):
        Instance.objects.create(
            instance_id=f"gone-{i}",
            role="worker",
            hostname="h",
            pid=i,
            started_at=now,
            last_seen=now - timedelta(days=1),
        )

    # When two passes run at the same moment on two connections
    reports: list[ReconcileReport] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait(timeout=10)
        # The setup's now: a minute turning since would take the oldest audited slot out of the window.
        reports.append(reconcile(now=now, repair=True, app=app))

    run_at_once([run, run], errors, timeout=60)
    assert not errors and len(reports) == 2

    # Then every change was made by exactly one of them
    made = [
        (change.kind, change.execution_id, change.detail)
        for report in reports
        for change in report.changes
        if change.kind != "published"  # a send may go out twice; the worker runs it once
    ]
    assert len(made) == len(set(made))
    assert sorted(kind for kind, _, _ in made) == sorted(
        ["lost_retrying"] * 20 + ["lost_failed"] * 20 + ["instance_removed"] * 10 + ["slot_recorded"] * 3
    )
    assert set(Execution.objects.filter(pk__in=[r.pk for r in retrying]).values_list("status", "attempt")) == {
        (Status.RETRYING, 2)
    }
    assert set(Execution.objects.filter(pk__in=[f.pk for f in failing]).values_list("status", flat=True)) == {
        Status.FAILED
    }
    target.refresh_from_db()
    assert (target.total_runs, target.consecutive_failures) == (20, 20)
    assert Execution.objects.filter(schedule=target, scheduled_for__in=slots).count() == 3
    assert Execution.objects.get(pk=pending.pk).status == Status.QUEUED
    assert not Instance.objects.exists()


# --- the leader ------------------------------------------------------------------------------


@pytest.mark.parametrize(("interval", "expected"), [(1e-6, Status.FAILED), (0, Status.RUNNING)])
def test_leader_tick__runs_reconcile_every_interval(
    settings: Any, beat_replica: BeatReplica, interval: float, expected: str
) -> None:
    # Given a reconcile interval (0 turns it off) and a lost execution with no retries left
    settings.SCHEDULER_RECONCILE_INTERVAL_SECONDS = interval
    lost = running_with_expired_lease("lost")
    scheduler = beat_replica()
    # When a replica ticks as leader
    scheduler.tick()
    assert scheduler.leadership.held
    if scheduler.housekeeping.reconciler is not None:  # the pass runs on a thread of its own
        scheduler.housekeeping.reconciler.join(timeout=30)
    scheduler.close()

    # Then its reconcile pass handled the execution, unless turned off
    assert Execution.objects.get(pk=lost.pk).status == expected

"""Reconcile: repair what crashes, lost messages and stray edits leave behind.

One pass recovers executions whose worker died, sends ``pending`` rows that
nobody sent and re-sends ``queued`` ones that nobody claimed, recomputes a
schedule's ``next_run_at`` when it is missing or not a slot of its timing,
drops instances that stopped sending heartbeats, and audits each schedule's
owed slots for ones without an Execution (recording them with ``repair``).
Every change is a conditional UPDATE or DELETE, or happens under a row lock,
so two passes at once (the leader's and an operator's) make each change once.
Each step looks at a bounded batch, so a pass stays cheap; the next pass
carries on. The audit walks the schedules round-robin by id, a budget of
schedules and of slots per pass, so over successive passes it sees them all.

A pass uses the calling thread's own database connection; a caller that
runs it on a thread of its own closes that connection when the thread ends.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import current_app
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now

from scheduler import outbox, timing, tracing
from scheduler.conf import settings
from scheduler.exceptions import BrokerUnavailable, ScheduleInvalid
from scheduler.failpoints import failpoint
from scheduler.fastpath import publisher
from scheduler.models import Execution, Instance, Schedule, tally
from scheduler.outbox import broker
from scheduler.owners import executions, instances, schedules, work_rules
from scheduler.timing import policies

if TYPE_CHECKING:
    from collections.abc import Sequence

    from celery import Celery

logger = logging.getLogger(__name__)

Status = Execution.Status

#: Rows each step handles per pass.
BATCH_SIZE = 1000
#: Schedules whose ``next_run_at`` is checked and whose slots are audited per pass.
AUDIT_SCHEDULES = 1000
#: Slots audited per schedule per pass.
AUDIT_SLOTS = 1000
#: Slots audited per pass, all schedules together; the pass stops before the schedule that would exceed it.
AUDIT_SLOTS_PER_PASS = 10_000
_TICK = timedelta(microseconds=1)

#: Each kind of change, as the summary line counts it.
KINDS = {
    "lost_retrying": "lost execution(s) retrying",
    "lost_failed": "lost execution(s) failed",
    "published": "old pending execution(s) sent",
    "republished": "unclaimed queued or retrying execution(s) sent again",
    "broker_lost": "execution(s) sent again after the broker lost its messages",
    "offered": "execution(s) waiting for a concurrency limit's place sent, a place being free",
    "next_run_at": "schedule(s) with next_run_at recomputed",
    "instance_removed": "stale instance(s) removed",
    "missing_slot": "slot(s) without an execution",
    "slot_recorded": "missing slot(s) recorded",
}


@dataclass(frozen=True)
class Change:
    """One thing a pass changed (or, in a dry run, would change), or one missing slot it found."""

    #: One of ``KINDS``.
    kind: str
    detail: str
    execution_id: int | None = None
    schedule_id: int | None = None


@dataclass(frozen=True)
class ReconcileReport:
    """What one reconcile pass did, change by change."""

    #: The database clock the pass ran against.
    now: datetime
    dry_run: bool
    repair: bool
    changes: tuple[Change, ...]
    #: Set when the broker refused a send; the pass's remaining sends did not go out.
    publish_error: str = ""

    @property
    def counts(self) -> dict[str, int]:
        """Return {kind: number of changes} for the kinds present."""
        return dict(Counter(change.kind for change in self.changes))

    @property
    def outcome(self) -> dict[str, int | str]:
        """Return the counts by kind, and why sending stopped if it did: what the pass's audit event keeps."""
        counts: dict[str, int | str] = dict(self.counts)
        return {**counts, "publish_error": self.publish_error} if self.publish_error else counts

    def summary(self) -> str:
        """Return one line counting the changes by kind."""
        if not self.changes:
            return "nothing to reconcile"
        counts = self.counts
        return ", ".join(f"{counts[kind]} {label}" for kind, label in KINDS.items() if kind in counts)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "counts": self.counts}


@dataclass
class _AuditCursor:
    """Where this process's next audit starts: after the id of the last schedule audited."""

    after_id: int = 0


#: Passes on several threads share it: two at once may audit the same
#: schedules, which is harmless (each change is made once).
_CURSOR = _AuditCursor()


@tracing.traced("scheduler.reconcile", after=tracing.reconciled_attributes)
def reconcile(
    *, now: datetime, dry_run: bool = False, repair: bool = False, app: Celery | None = None
) -> ReconcileReport:
    """Run one reconcile pass against the database clock ``now``; return what it changed.

    ``dry_run`` computes the same report and changes nothing. ``repair``
    records the slots the audit finds missing, under each schedule's misfire
    policy. The audit continues where this process's previous pass stopped
    (a dry run leaves that place as it is). Sends go out at the end of the
    pass; a broker error stops them and is reported in ``publish_error``
    rather than raised.
    """
    app = app or current_app
    lost, to_send = _recover_lost(now=now, dry_run=dry_run)
    pending = _old_pending(now=now)
    queued = _unclaimed_queued(now=now, dry_run=dry_run, app=app)
    batch = _audit_batch(after_id=_CURSOR.after_id)
    fixed = _fix_next_run_at(_unset_next_run_at(exclude=batch) + batch, now=now, dry_run=dry_run)
    instances = _remove_stale_instances(now=now, dry_run=dry_run)
    audited, recorded, last_id = _audit(batch, now=now, dry_run=dry_run, repair=repair)
    if not dry_run and last_id is not None:
        _CURSOR.after_id = last_id
    if not dry_run:
        tally.fold()  # the execution tallies' increments: few left for /metrics to read, scraped or not
    publish_error = ""
    if not dry_run:
        resend = [change.execution_id for change in pending + queued]
        sent, publish_error = _send(app, [*to_send, *recorded, *resend], now=now)
        pending = [change for change in pending if change.execution_id in sent]
        queued = [change for change in queued if change.execution_id in sent]
    offered, offer_error = ([], "") if dry_run else _offer_free_places(app)
    publish_error = publish_error or offer_error
    changes = (*lost, *pending, *queued, *offered, *fixed, *instances, *audited)
    return ReconcileReport(now=now, dry_run=dry_run, repair=repair, changes=changes, publish_error=publish_error)


# --- executions ----------------------------------------------------------------------


def _recover_lost(*, now: datetime, dry_run: bool) -> tuple[list[Change], list[int]]:
    """Mark running executions whose claim expired ``lost``, then retry or fail each lost one.

    Return the changes and the ids to send again. A retry is due after the
    backoff, as after a failed attempt: its message waits until then. A
    failure counts on the schedule as a worker-recorded one does (circuit
    breaker included).
    """
    expired = Execution.objects.filter(status=Status.RUNNING, claim_expires_at__lt=Now())
    if dry_run:
        lost = Execution.objects.filter(Q(status=Status.LOST) | Q(pk__in=expired.values("pk")))
    else:
        ids = list(expired.order_by("id").values_list("id", flat=True)[:BATCH_SIZE])
        executions.mark_lost(ids)
        lost = Execution.objects.filter(status=Status.LOST)
    changes: list[Change] = []
    retry: list[int] = []
    for execution in lost.order_by("id")[:BATCH_SIZE]:
        failpoint("reconcile.after_mark_lost")
        attempt = execution.attempt
        lost_count = executions.lost_attempts(attempt, execution.attempt_errors)
        if executions.lost_retries_left(lost_count, execution.max_retries):
            change = Change(
                "lost_retrying",
                f"{executions.lost_error(attempt)}; retrying as attempt {attempt + 1}",
                execution.pk,
                execution.schedule_id,
            )
            if not dry_run and not _retry_lost(execution, due=now + timedelta(seconds=_backoff(execution))):
                continue
            retry.append(execution.pk)
        else:
            reason = f"{executions.lost_error(attempt)}; no retries left"
            change = Change("lost_failed", reason, execution.pk, execution.schedule_id)
            if not dry_run and not _fail_lost(execution, reason):
                continue
        changes.append(change)
    return changes, retry


def _backoff(execution: Execution) -> float:
    """Return the seconds before the attempt after ``execution``'s current one, jittered."""
    return policies.retry_delay(
        execution.attempt, base=execution.retry_backoff, cap=settings.RETRY_BACKOFF_MAX_SECONDS, spread=random.random()
    )


def _retry_lost(execution: Execution, *, due: datetime) -> bool:
    return executions.retry_lost(execution.pk, due=due)


def _fail_lost(execution: Execution, reason: str) -> bool:
    failed = executions.fail_lost(execution, reason=reason)
    if failed:
        logger.error(
            "execution %s failed: %s",
            execution.pk,
            reason,
            extra={"action": "execution_failed", "execution_id": execution.pk},
        )
    return bool(failed)


def _old_pending(*, now: datetime) -> list[Change]:
    """Return a change per ``pending`` execution nobody sent in time (sent at the end of the pass)."""
    cutoff = now - timedelta(seconds=settings.RECONCILE_PENDING_AFTER_SECONDS)
    old = Execution.objects.filter(status=Status.PENDING, buffered=False, created_at__lt=cutoff).order_by(
        "created_at", "id"
    )
    return [
        Change("published", f"pending since {created_at.isoformat()}; sent", pk, schedule_id)
        for pk, schedule_id, created_at in old.values_list("id", "schedule_id", "created_at")[:BATCH_SIZE]
    ]


def _unclaimed_queued(*, now: datetime, dry_run: bool, app: Celery) -> list[Change]:
    """Take the ``queued`` (and due ``retrying``) executions no worker claimed in time, to be sent again.

    A ``retrying`` row's ``enqueued_at`` is when its retry was due; its
    message may have been lost with a broker restart or a killed worker, or
    never sent (the broker was down when the worker retried). A row without
    ``enqueued_at`` (a plain Celery call recorded before every ``queued``
    row had one) waits since it was recorded. A row whose message was to
    start later (its schedule's jitter) waits from then.

    On Redis, a row whose queue still holds messages in the broker is left
    alone: its message most likely waits behind them, and sending it again
    on every threshold would only swell a long queue with copies. Nothing
    is taken while the broker does not answer (nothing could be sent), so
    the next check after it answers sends what waited too long.

    Their ``enqueued_at`` moves to ``now`` (one conditional UPDATE each), so
    a concurrent pass does not take them too and the next re-send waits a
    full threshold. The worker claims each execution once, so a message that
    was only slow is harmless.
    """
    cutoff = now - timedelta(seconds=settings.RECONCILE_QUEUED_AFTER_SECONDS)
    waited = Q(enqueued_at__lt=cutoff) | Q(enqueued_at__isnull=True, created_at__lt=cutoff)
    stale = Execution.objects.filter(waited, status__in=[Status.QUEUED, Status.RETRYING], scheduled_for__lt=cutoff)
    held = work_rules.held(work_rules.pauses_in_force(max_age=0))
    if held is not None:  # held by a pause rule: lifting the rule sends it (operations.resume_work)
        stale = stale.exclude(held)
    stale = stale.filter(
        concurrency_key__isnull=True
    )  # waiting for a concurrency limit's place: _offer_free_places sends it
    rows = [
        row
        for row in stale.order_by("enqueued_at", "id").values(
            "id",
            "schedule_id",
            "enqueued_at",
            "created_at",
            "scheduled_for",
            "status",
            "task",
            "queue",
            jitter=F("schedule__jitter"),
        )[:BATCH_SIZE]
        if row["status"] == Status.RETRYING or publisher.start_at(row) < cutoff
    ]
    if not rows:
        return []
    try:
        holding = broker.queues_holding_messages(app, {_queue_name(app, row) for row in rows})
    except BrokerUnavailable:
        return []
    changes: list[Change] = []
    for row in rows:
        if holding is not None and _queue_name(app, row) in holding:
            continue
        pk, enqueued_at = row["id"], row["enqueued_at"]
        if not dry_run and not executions.mark_resent(pk, was_enqueued_at=enqueued_at, now=now):
            continue
        since = (enqueued_at or row["created_at"]).isoformat()
        changes.append(
            Change("republished", f"waiting since {since}, never claimed; sent again", pk, row["schedule_id"])
        )
    return changes


def _offer_free_places(app: Celery) -> tuple[list[Change], str]:
    """Send the executions that wait for a concurrency limit's place which is free (its holder died, or its offer was lost).

    After ``_recover_lost``, which frees the places of the executions whose
    worker stopped renewing their claims.
    """
    try:
        sent = outbox.offer_places(app, executions.waiting_keys(), max_age=0)
    except BrokerUnavailable as exc:
        return [], f"broker unreachable: {exc}; executions waiting for a free concurrency limit's place not sent yet"
    return [Change("offered", "waited for a concurrency limit's place, now free; sent", pk) for pk in sent], ""


def _queue_name(app: Celery, row: dict[str, Any]) -> str:
    """Return the broker queue the row's message goes to: its own ``queue``, else where Celery routes its task."""
    try:
        target = app.amqp.router.route({"queue": row["queue"]} if row["queue"] else {}, row["task"]).get("queue")
    except Exception:  # noqa: BLE001 -- a route that cannot be resolved here: the row's own queue, or the default
        target = None
    return getattr(target, "name", target) or row["queue"] or app.conf.task_default_queue


@tracing.traced("scheduler.reconcile.resend_unclaimed", after=tracing.reconciled_attributes)
def resend_unclaimed(*, now: datetime, app: Celery | None = None) -> ReconcileReport:
    """Send again the executions that waited unclaimed past ``RECONCILE_QUEUED_AFTER_SECONDS`` (see ``_unclaimed_queued``).

    The fallback for a message the broker lost without ``resend_after_broker_restart``
    seeing it (a broker that is not Redis, a queue deleted by hand); the
    leader runs it with every broker check, so such a message is sent again
    within the threshold and one check of its loss.
    """
    app = app or current_app
    queued = _unclaimed_queued(now=now, dry_run=False, app=app)
    sent, publish_error = _send(app, [change.execution_id for change in queued], now=now)
    changes = tuple(change for change in queued if change.execution_id in sent)
    return ReconcileReport(now=now, dry_run=False, repair=False, changes=changes, publish_error=publish_error)


def _send(app: Celery, ids: Sequence[int | None], *, now: datetime) -> tuple[set[int], str]:
    """Send the executions ``ids`` that still wait for a worker; return the ids sent and any broker error."""
    sent: set[int] = set()
    waiting = Execution.objects.filter(status__in=[Status.PENDING, Status.QUEUED, Status.RETRYING], buffered=False)
    for index in range(0, len(ids), BATCH_SIZE):
        rows = _at_due_time(executions.message_rows(waiting.filter(id__in=ids[index : index + BATCH_SIZE])))
        try:
            failpoint("reconcile.resend")
            sent.update(outbox.publish(app, rows, now=now))
        except BrokerUnavailable as exc:
            unsent = len(set(ids) - sent)
            return sent, f"broker unreachable: {exc}; {unsent} execution(s) not sent yet"
    return sent, ""


def _at_due_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Make each ``retrying`` row's message wait for its retry's due time (its ``enqueued_at``).

    ``outbox.publish`` sends a message at the row's ``scheduled_for`` (plus
    jitter); for a retry that is the slot, long past, so the due time takes
    its place in the message, not in the database.
    """
    retries = [row["id"] for row in rows if row["status"] == Status.RETRYING]
    due = dict(Execution.objects.filter(id__in=retries, enqueued_at__isnull=False).values_list("id", "enqueued_at"))
    for row in rows:
        if row["id"] in due and due[row["id"]] > row["scheduled_for"]:
            row.update(scheduled_for=due[row["id"]], jitter=None)
    return rows


# --- broker restarts -----------------------------------------------------------------


@dataclass
class _BrokerResend:
    """This process's re-send of the executions whose messages one broker run lost."""

    #: The broker run (Redis ``run_id``) that came up without them.
    run_id: str = ""
    #: When the leader first saw that run: ``queued`` rows sent before it may be lost.
    seen_at: datetime | None = None
    #: Rows are re-sent by id; the next batch starts after this one.
    after_id: int = 0


_BROKER_RESEND = _BrokerResend()


@tracing.traced("scheduler.reconcile.broker_check", after=tracing.reconciled_attributes)
def resend_after_broker_restart(*, now: datetime, app: Celery | None = None) -> ReconcileReport:
    """Send again the waiting executions whose messages the broker lost; change nothing while it kept them.

    The broker tells whether it may have lost its messages (``broker``: its
    run id against the marker the leader left there). Then every ``queued``
    execution sent before ``now`` of the first call that saw it, and every
    ``retrying`` one (its message waits in a worker for the retry's due
    time, and is lost with the broker), is sent again, ``BATCH_SIZE`` per
    call; a retry's message keeps its due time. A leader's own sends since
    it took the lease are no exception: the broker may have restarted after
    they went out. Once all are sent the broker
    run is confirmed, and later calls send nothing until it loses its
    messages again. A long queue on a broker that kept it is never re-sent.
    An execution sent twice is claimed once, so a message the broker did keep
    costs one refused duplicate. A broker that does not answer is reported
    in ``publish_error`` and the next call tries again.
    """
    app = app or current_app
    try:
        run_id = broker.unconfirmed_run(app)
    except BrokerUnavailable as exc:
        return ReconcileReport(
            now=now, dry_run=False, repair=False, changes=(), publish_error=f"broker unreachable: {exc}"
        )
    if run_id is None:
        return ReconcileReport(now=now, dry_run=False, repair=False, changes=())
    state = _BROKER_RESEND
    if state.run_id != run_id or state.seen_at is None:
        state.run_id, state.seen_at, state.after_id = run_id, now, 0
    sent_before = Q(enqueued_at__lt=state.seen_at) | Q(enqueued_at__isnull=True, created_at__lt=state.seen_at)
    lost = Execution.objects.filter(
        Q(sent_before, status=Status.QUEUED) | Q(status=Status.RETRYING), id__gt=state.after_id
    )
    ids = list(lost.order_by("id").values_list("id", flat=True)[:BATCH_SIZE])
    sent, publish_error = _send(app, ids, now=now)
    if publish_error:
        return ReconcileReport(now=now, dry_run=False, repair=False, changes=(), publish_error=publish_error)
    if ids:
        state.after_id = ids[-1]
    if len(ids) < BATCH_SIZE:
        try:
            broker.confirm_run(app, run_id)
            state.seen_at, state.after_id = None, 0
        except BrokerUnavailable as exc:
            publish_error = f"broker unreachable: {exc}"  # the next call confirms it
    changes = tuple(
        Change("broker_lost", f"broker restarted (run {run_id}) and may have lost its message; sent again", pk)
        for pk in ids
        if pk in sent
    )
    return ReconcileReport(now=now, dry_run=False, repair=False, changes=changes, publish_error=publish_error)


# --- schedules and instances -----------------------------------------------------------


def _audit_batch(*, after_id: int) -> list[Schedule]:
    """Return up to ``AUDIT_SCHEDULES`` active schedules by id after ``after_id``, then from the lowest ids."""
    active = Schedule.objects.active().order_by("id")
    batch = list(active.filter(id__gt=after_id)[:AUDIT_SCHEDULES])
    if len(batch) < AUDIT_SCHEDULES:
        batch += list(active.filter(id__lte=after_id)[: AUDIT_SCHEDULES - len(batch)])
    return batch


def _unset_next_run_at(*, exclude: list[Schedule]) -> list[Schedule]:
    """Return active schedules without ``next_run_at`` (not among ``exclude``), ``AUDIT_SCHEDULES`` at most."""
    unset = Schedule.objects.active().filter(next_run_at__isnull=True).exclude(pk__in=[s.pk for s in exclude])
    return list(unset.order_by("id")[:AUDIT_SCHEDULES])


def _fix_next_run_at(audited: list[Schedule], *, now: datetime, dry_run: bool) -> list[Change]:
    """Recompute ``next_run_at`` where it is missing, or is not a slot of the schedule's cron or interval.

    A ``next_run_at`` in the past is left alone: that schedule is simply due.
    The schedules' ``next_run_at`` is updated in memory too (for the audit).
    """
    changes: list[Change] = []
    for schedule in audited:
        current = schedule.next_run_at
        try:
            if current is not None and (
                schedule.run_at is not None or timing.next_slot(schedule.timing, after=current - _TICK) == current
            ):
                continue
            expected = schedule.compute_next_run_at(now=now)
        except ScheduleInvalid:
            continue  # the beat pauses it with the reason when it comes due
        if expected == current:
            continue
        if not dry_run and not schedules.fix_next_run_at(schedule, was=current, to=expected):
            continue
        schedule.next_run_at = expected
        was = current.isoformat() if current else "unset"
        now_at = expected.isoformat() if expected else "none (no slots left)"
        reason = "was unset" if current is None else "was not a slot of its timing"
        changes.append(
            Change("next_run_at", f"{schedule.name}: next_run_at {was} -> {now_at} ({reason})", None, schedule.pk)
        )
    return changes


def _remove_stale_instances(*, now: datetime, dry_run: bool) -> list[Change]:
    cutoff = now - timedelta(seconds=settings.RECONCILE_INSTANCE_STALE_SECONDS)
    stale = Instance.objects.filter(last_seen__lt=cutoff)
    changes: list[Change] = []
    for instance in stale.order_by("last_seen")[:BATCH_SIZE]:
        if not dry_run and not instances.remove_stale(instance, cutoff=cutoff):
            continue
        changes.append(
            Change(
                "instance_removed",
                f"{instance.role} {instance.instance_id}, last seen {instance.last_seen.isoformat()}",
            )
        )
    return changes


# --- audit -------------------------------------------------------------------------------


def _audit(
    schedules: list[Schedule], *, now: datetime, dry_run: bool, repair: bool
) -> tuple[list[Change], list[int], int | None]:
    """Find each schedule's owed slots that have no Execution; with ``repair`` record them.

    A slot is owed from the schedule's ``owed_since`` (moved on resume,
    re-enable and timing edits), within its catch-up window and the
    retention of finished executions (older rows may have been pruned),
    after its ``pruned_through`` (the newest slot a prune deleted, whatever
    that prune's arguments) and before its ``next_run_at`` (that slot and
    later ones are the beat's to fire). Schedules are read before their
    executions, and the beat commits a schedule's rows with its
    ``next_run_at``, so a slot the beat is firing right now is never taken
    for a missing one. A prune commits its deletes with its mark, so the
    marks are read again after the executions: a slot a prune deleted in
    between is not taken for a missing one either.

    At most ``AUDIT_SLOTS_PER_PASS`` slots are looked at; the audit stops
    before the first schedule that does not fit. Return the changes, the
    ids of recorded executions to send and the id of the last schedule
    audited (``None`` when none was).
    """
    expected: list[tuple[Schedule, list[datetime], list[str]]] = []
    # Rows older than the retention may have been pruned: their slots are not audited.
    horizon = now - timedelta(days=settings.PRUNE_OLDER_THAN_DAYS)
    budget, last_id = AUDIT_SLOTS_PER_PASS, None
    for schedule in schedules:
        window_start = now - timedelta(seconds=schedule.catchup_window)
        starts = (schedule.owed_since or schedule.created_at, window_start, horizon, schedule.pruned_through)
        since = max(start for start in starts if start is not None)
        until = now if schedule.next_run_at is None else min(schedule.next_run_at - _TICK, now)
        limit = min(AUDIT_SLOTS, budget)
        try:
            slots = timing.slots_between(schedule.timing, since=since, until=until, limit=limit)
        except ScheduleInvalid:
            slots = []
        if len(slots) == limit < AUDIT_SLOTS:
            break  # it may own more slots than this pass has left: the next pass starts with it
        budget -= len(slots)
        last_id = schedule.pk
        if slots:
            expected.append((schedule, slots, [executions.key(schedule, slot) for slot in slots]))
    present = _present_keys([key for _, _, keys in expected for key in keys])
    pruned = _pruned_through([schedule.pk for schedule, _, keys in expected if not present.issuperset(keys)])
    changes: list[Change] = []
    to_send: list[int] = []
    for schedule, slots, keys in expected:
        mark = pruned.get(schedule.pk)
        missing = [slot for slot, key in zip(slots, keys) if key not in present and (mark is None or slot > mark)]
        if not missing:
            continue
        if not repair:
            changes += [
                Change("missing_slot", f"{schedule.name}: slot {slot.isoformat()} has no execution", None, schedule.pk)
                for slot in missing
            ]
            continue
        plan = _misfire_plan(schedule.misfire, missing, latest_slot=slots[-1])
        recorded: list[dict[str, Any]]
        if dry_run:
            recorded = [{"id": None, "scheduled_for": slot, "status": status} for slot, status in plan]
        else:
            recorded = _record(schedule, plan, now=now)
        for row in recorded:
            detail = (
                f"{schedule.name}: slot {row['scheduled_for'].isoformat()} had no execution; recorded {row['status']}"
            )
            changes.append(Change("slot_recorded", detail, row["id"], schedule.pk))
        to_send += [row["id"] for row in recorded if row["status"] == Status.PENDING and row["id"] is not None]
    return changes, to_send, last_id


def _present_keys(keys: list[str]) -> set[str]:
    """Return which of ``keys`` an Execution has, ``BATCH_SIZE`` keys per query."""
    present: set[str] = set()
    for index in range(0, len(keys), BATCH_SIZE):
        chunk = keys[index : index + BATCH_SIZE]
        present.update(Execution.objects.filter(idempotency_key__in=chunk).values_list("idempotency_key", flat=True))
    return present


def _pruned_through(schedule_ids: list[int]) -> dict[int, datetime | None]:
    """Return each schedule's ``pruned_through`` as it is now (the executions were read before)."""
    marks: dict[int, datetime | None] = {}
    for index in range(0, len(schedule_ids), BATCH_SIZE):
        chunk = schedule_ids[index : index + BATCH_SIZE]
        marks.update(Schedule.objects.filter(pk__in=chunk).values_list("pk", "pruned_through"))
    return marks


def _misfire_plan(misfire: str, missing: list[datetime], *, latest_slot: datetime) -> list[tuple[datetime, str]]:
    """Return (slot, status) for late slots by the misfire policy, as the beat would have.

    ``run_all`` runs them all and ``skip`` none; ``run_once`` runs the latest
    slot of the window if it is among them (a later one that ran already
    counts as the one run), the others are ``missed``.
    """
    if misfire == Schedule.Misfire.RUN_ALL:
        return [(slot, Status.PENDING) for slot in missing]
    runs = {missing[-1]} if misfire == Schedule.Misfire.RUN_ONCE and missing[-1] == latest_slot else set()
    return [(slot, Status.PENDING if slot in runs else Status.MISSED) for slot in missing]


def _record(schedule: Schedule, plan: list[tuple[datetime, str]], *, now: datetime) -> list[dict[str, Any]]:
    with transaction.atomic():
        # A prune marks the schedule under this lock: none can commit between this read and the insert.
        locked = Schedule.objects.select_for_update().filter(pk=schedule.pk)
        mark = locked.values_list("pruned_through", flat=True).first()
        plan = [(slot, status) for slot, status in plan if mark is None or slot > mark]
        recorded = executions.record_slots(schedule, plan, now=now)
        missed = sum(1 for row in recorded if row["status"] == Status.MISSED)
        if missed:
            schedules.add_missed(schedule.pk, missed)
    return recorded

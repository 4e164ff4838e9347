"""ExecutionTask: the guard every task of the project's Celery app runs under.

A body runs only under its execution's claim, once per attempt, and every
write after the claim is fenced by that attempt; a delivery that claims
nothing is acknowledged, logged and not run. Before a body runs, the worker
claims its Execution row with one conditional UPDATE. Nothing is claimed for
a duplicate delivery (the execution is already running elsewhere, or done),
nor for a message that merely names the execution in its header (one a
``celery.group`` carried, say): only the message sent for an execution, with
the row's task name and task id, claims it; the others are counted as
refused (``scheduler_messages_refused_total``). While the body runs, the
process's claim renewer (``scheduler.worker.renewer``) keeps the claim alive,
and stops a body whose claim is gone. ``scheduler.owners.executions`` owns
every status change; this module holds only Celery's hooks. The outcome and
the schedule's counters are written in one transaction.

A task called the plain Celery way (no execution id in the message) is
recorded as an ad-hoc Execution keyed by its Celery task id, so a redelivery
of that message is deduplicated the same way.

A body that raises with retries left ends its attempt as ``retrying``, due
after the backoff, before Celery sends the retry's message; a message that
comes before the retry is due claims nothing. When Celery cannot send it
(the broker is down), the execution stays ``retrying`` and the process keeps
no claim on it: the leader sends it once the broker answers (``reconcile``).

Time limits come from the execution's ``timeout``: the soft limit raises
``SoftTimeLimitExceeded`` inside the task (recorded ``timed_out``), the hard
limit ``TIMEOUT_GRACE_SECONDS`` later kills the pool child (recorded
``timed_out`` by ``GuardedRequest.on_timeout``, which Celery calls in the
worker's main process). Only the prefork pool (Celery's default) enforces both; with the
``solo`` and ``threads`` pools a task runs past its timeout. No timeout means
no limit. Timed-out executions are final; they are not retried.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta, timezone
from typing import Any, TypeVar

from celery import Task, current_task
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from celery.signals import task_postrun, task_prerun, worker_init, worker_process_init
from celery.worker.request import Request
from celery.worker.state import task_ready
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    connections,
)

from scheduler import clock, dbclock, limits, logs, outbox, process_ids, tracing
from scheduler.conf import settings
from scheduler.exceptions import BrokerUnavailable, MessageRefused, NotInTask
from scheduler.failpoints import failpoint
from scheduler.fastpath import celery_result
from scheduler.models import Execution, PauseRule
from scheduler.owners import executions, work_rules
from scheduler.owners.executions import Claim
from scheduler.timing import policies
from scheduler.worker.renewer import ClaimRenewer
from scheduler.worker.running import RunningExecution

logger = logging.getLogger(__name__)

#: Attribute of the Celery request context that holds the claimed Execution row.
_ROW_ATTR = "scheduler_execution_row"
#: Attribute of the Celery request context that holds its ``RunningExecution``, once the body asked for it.
_RUNNING_ATTR = "scheduler_execution"
#: Attribute of the Celery request context that holds the ``Claim`` (the fencing token).
_CLAIM_ATTR = "scheduler_claim"
#: The request attribute that holds the concurrency place its execution runs under, if any.
_PLACE_ATTR = "scheduler_place"
#: The request attribute that holds when (monotonic clock) its rate limit lets the body start, if one governs it.
_START_ATTR = "scheduler_start_at"
#: Results longer than this (as JSON) are stored truncated.
RESULT_SUMMARY_MAX_CHARS = 10_000
#: A message that finds its retry due within this long waits for it rather than being refused:
#: the worker's clock, which timed the message, may run a little ahead of the database's.
EARLY_RETRY_WAIT_SECONDS = 2.0  # seconds
#: A body cut off from its database runs again this long after: time for a restarting server to answer.
CONNECTION_LOST_RETRY_SECONDS = 1.0  # seconds


class _RetryNotSent(Ignore):
    """The retry's message could not be sent; the execution stays ``retrying`` for someone else to send.

    An ``Ignore``: the message is acknowledged and no Celery result is
    stored. Celery's own ``Reject`` (not requeued) would have the worker
    store FAILURE for the task id, which the retry sent later reuses: a
    worker's main process still cut off from the broker stores it late,
    over the retry's SUCCESS. Told apart from a body's error by the guard.
    """


#: Found: the execution's id, and its task, queue and tenant (what the work rules match).
_Found = tuple[int, dict[str, str]]
#: A rate limit's start this far away, or nearer, is waited for in the pool process; a later one is sent later.
RATE_WAIT_SECONDS = 5.0
#: The share of a time limit a rate limit's wait in the pool process may take (Celery's timer is running).
RATE_WAIT_SHARE_OF_LIMIT = 0.1


def _ruled() -> bool:
    """Whether any work rule (pause, concurrency or rate limit) is in force, as this process read them lately."""
    return bool(work_rules.pauses_in_force() or work_rules.limits_in_force() or work_rules.rates_in_force())


def _routing_if_ruled(target: dict[str, Any]) -> _Found | None:
    """The execution ``target`` names, as the work rules match it; ``None`` (and no query) while no rule is in force."""
    return executions.routing_of(**target) if _ruled() else None


def _place_of(found: _Found, args: Any, kwargs: Any) -> work_rules.Place | None:
    """The concurrency place the execution must take; ``None`` when no limit governs it."""
    limit = work_rules.governing(work_rules.limits_in_force(), **found[1])
    return None if limit is None else limit.place(*_arguments(args, kwargs))


def _arguments(args: Any, kwargs: Any) -> tuple[Any, Any]:
    return (args if isinstance(args, (list, tuple)) else (), kwargs if isinstance(kwargs, dict) else {})


def _rate_wait_allowed(time_limits: tuple[float | None, float | None] | None) -> float:
    """How long a body may wait for its rate limit's start in the pool process, under its (hard, soft) time limits.

    The pool's timer runs from the moment it took the message: a wait there
    is taken from the body's time, so it may use only a small share of it.
    """
    given = [limit for limit in (time_limits or ()) if limit]
    return min([RATE_WAIT_SECONDS, *(limit * RATE_WAIT_SHARE_OF_LIMIT for limit in given)])


def _keep_to_rate(found: _Found, args: Any, kwargs: Any, app: Any, *, wait_allowed: float) -> float | None:
    """Take the execution's start under its rate limit; return when to start it (monotonic clock), or raise ``Ignore``.

    A start at most ``wait_allowed`` away is taken, and the body waits for
    it in this process once claimed (the end of ``before_start``). A later
    one is not taken: the message is acknowledged and sent again to arrive
    that much before it, so no pool process waits long, nor eats into a
    time limit. ``None``: no rate limit governs it.
    """
    rate = work_rules.governing(work_rules.rates_in_force(), **found[1])
    if rate is None:
        return None
    reservation = work_rules.reserve_start(rate, rate.key_of(*_arguments(args, kwargs)), within=wait_allowed)
    if reservation.reserved:
        return time.monotonic() + reservation.seconds
    due = dbclock.now() + timedelta(seconds=reservation.seconds - wait_allowed)
    try:
        outbox.publish(app, executions.send_later(found[0], due=due), now=dbclock.now())
    except BrokerUnavailable:  # reconcile sends it, once it waited unclaimed past its due time
        pass
    logger.info(
        "execution %s delayed by rate limit %s: its next start is %.1fs away; sent again for %s",
        found[0],
        rate.name,
        reservation.seconds,
        due.isoformat(),
        extra={"action": "rate_delay", "execution_id": found[0]},
    )
    raise Ignore()


def _offer_freed_place(app: Any, place: work_rules.Place) -> None:
    """After an execution left ``place``: send the oldest ones waiting for it. A failure waits for reconcile's pass."""
    try:
        outbox.offer_places(app, [place.key])
    except (BrokerUnavailable, DatabaseError) as error:
        logger.warning(
            "could not offer the freed place of %s: %s; the next reconcile pass offers it",
            place.key,
            error,
            extra={"action": "offer_failed"},
        )


def _wait_for_place(target: dict[str, Any], place: work_rules.Place) -> None:
    """Raise ``Ignore`` when the claim found no free place: the execution waits ``queued`` until one frees.

    The message is acknowledged; the execution is sent again when a place of
    its key frees (``outbox.offer_places``), oldest first.
    """
    waiting = executions.wait_for_place(**target)
    if waiting is None:
        return
    key, number = waiting
    logger.info(
        "execution %s waits for a place of %s (limit %s): number %s in line",
        target.get("execution_id") or target.get("key"),
        key,
        place.limit,
        number,
        extra={"action": "concurrency_wait", "execution_id": target.get("execution_id"), "concurrency_key": key},
    )
    raise Ignore()


def _refuse_if_paused(found: _Found) -> None:
    """Raise ``Ignore`` when a pause rule holds the execution: it waits, or a drain cancels it.

    The message is acknowledged either way; a held execution stays
    ``queued``, and lifting the rule sends it again (``operations.resume_work``).
    """
    rules = work_rules.pauses_in_force()
    if not rules:
        return
    execution_id, routing = found
    if work_rules.matching(rules, **routing) is None:
        return
    # Confirmed on fresh rules: a resume deletes its rule and then sends the
    # held executions again, which a stale cache would hold once more, for good.
    rule = work_rules.matching(work_rules.pauses_in_force(max_age=0), **routing)
    if rule is None:
        return
    if rule.mode == PauseRule.Mode.DRAIN:
        executions.cancel(execution_id, reason=f"Drained: {rule.reason or 'paused'}", now=clock.now())
    logger.info(
        "execution %s %s by pause rule %s: not run",
        execution_id,
        "cancelled" if rule.mode == PauseRule.Mode.DRAIN else "held",
        rule.pk,
        extra={"action": f"pause_{rule.mode}", "execution_id": execution_id},
    )
    raise Ignore()


def current_execution() -> RunningExecution | None:
    """Return the execution the calling task is running, or ``None`` outside one.

    Reads fall through to the Execution row as claimed; ``checkpoint(data)``
    saves progress and ``last_checkpoint`` reads it (``scheduler.worker.running``).
    """
    task = current_task
    if not task:
        return None
    request = task.request
    running: RunningExecution | None = getattr(request, _RUNNING_ATTR, None)
    row, claim = getattr(request, _ROW_ATTR, None), getattr(request, _CLAIM_ATTR, None)
    if running is None and row is not None and claim is not None:
        # Built when the body first asks (most never do); a fenced block that records the outcome ends the claim.
        running = RunningExecution(row, claim, on_succeeded=_renewer.drop)
        setattr(request, _RUNNING_ATTR, running)
    return running


def fenced() -> AbstractContextManager[None]:
    """Return ``with scheduler.fenced():``: the block's writes commit with the ``succeeded`` outcome, or not at all.

    Raises ``NotInTask`` outside a task run under the guard; see ``RunningExecution.fenced``.
    """
    running = current_execution()
    if running is None:
        raise NotInTask("fenced() works only inside a task run by a worker under the execution guard")
    return running.fenced()


def current_claim() -> Claim | None:
    """Return the ``Claim`` the calling task runs under (its fencing token), or ``None`` outside one."""
    task = current_task
    if not task:
        return None
    return getattr(task.request, _CLAIM_ATTR, None)


def _write_outcome(task: Task, claim: Claim, **outcome: Any) -> int:
    """Write this attempt's outcome (``executions.finish``); have Celery store its result only if it was recorded.

    Not recorded (the claim moved on to a later attempt, the execution was
    cancelled) or not written (a database error, raised on): the task id's
    result is the attempt's whose outcome the row holds, and this one must
    not overwrite it. The body's value or error goes on as usual (signals,
    logs, links); only the result backend is left alone.
    """
    recorded = 0
    try:
        recorded = _reconnecting(executions.finish, claim, **outcome)
    finally:
        if not recorded:
            task.request.ignore_result = True
    return recorded


def _result_summary(value: Any) -> Any:
    """Return ``value`` if it is small JSON, else a bounded description of it."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return {"repr": repr(value)[:1000]}
    if len(text) > RESULT_SUMMARY_MAX_CHARS:
        return {"truncated": text[:1000], "length": len(text)}
    # (a NUL, a lone surrogate, NaN or Infinity would make the outcome's write fail: replaced)
    return limits.storable(value) if "\\u" in text or "NaN" in text or "Infinity" in text else value


def _error_text(exc: BaseException) -> str:
    return limits.storable(f"{type(exc).__name__}: {exc}")


def _traceback_text(exc: BaseException) -> str:
    return limits.storable("".join(traceback.format_exception(exc)))


# --- claims ----------------------------------------------------------------------------


#: Renews this process's claims; stops a body whose claim is gone (``scheduler.worker.renewer``).
_renewer = ClaimRenewer()


@worker_process_init.connect
def _in_pool_child(**_: Any) -> None:
    """A prefork pool child runs one body at a time: a body whose claim is gone is stopped by exiting."""
    _renewer.exit_on_loss = True


@task_postrun.connect
def _claim_ends_with_its_task(sender: Task, **_: Any) -> None:
    """Stop renewing the task's claim however the task ended: a claim renewed past its body would hold the execution.

    Every way out of the guard drops the claim already; this makes sure no
    path missed (the process would renew it for the rest of its life, and
    stop whatever it runs later once the execution moves on).
    """
    claim = getattr(sender.request, _CLAIM_ATTR, None)
    if claim is not None:
        _renewer.drop(claim)


# --- database connections ----------------------------------------------------------------


@worker_init.connect
def _keep_connections(**_: Any) -> None:
    """Let this worker's processes keep a database connection across tasks (``WORKER_CONN_MAX_AGE``).

    Opening one per task costs more than the guard's own statements. Set in
    the main process before the pool forks, so every child inherits it; a
    reused connection is checked first (``CONN_HEALTH_CHECKS``), so one the
    server dropped meanwhile is replaced, not used.
    """
    for alias in connections:
        connections.settings[alias].update(CONN_MAX_AGE=settings.WORKER_CONN_MAX_AGE, CONN_HEALTH_CHECKS=True)


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(sender: Task, **_: Any) -> None:
    """Close a connection past its age or left unusable, around each task (as Django does around a request).

    Celery's Django fixup no longer closes it every task (``CELERY_DB_REUSE_MAX``
    in the settings). An eager call runs inside its caller's transaction: left alone.
    """
    if not getattr(sender.request, "is_eager", False):
        _discard_interrupted_transaction()
        close_old_connections()


def _discard_interrupted_transaction() -> None:
    """Close this thread's connection if a transaction is open on it between tasks; open a fresh one next.

    An exception raised by a signal handler (Celery's soft time limit) can
    land inside Django's transaction bookkeeping: after ``BEGIN`` and before
    Django noted the block, or in its exit before ``COMMIT``. The session is
    then in a transaction Django does not know about, and never ends it: on
    SQLite its write lock stops every process's writes; on PostgreSQL its
    writes are never committed and its row locks held. Between two tasks no
    transaction may be open, so one that is, is discarded (rolled back) with
    the connection and Django's bookkeeping of it.
    """
    wrapper = connections[DEFAULT_DB_ALIAS]
    raw = wrapper.connection
    if raw is None:
        return
    if wrapper.vendor == "sqlite":
        open_ = raw.in_transaction
    else:  # psycopg: outside a transaction it is idle, and in autocommit as Django keeps it
        from psycopg import pq  # only here: an install for SQLite alone has no psycopg

        open_ = raw.info.transaction_status != pq.TransactionStatus.IDLE or raw.autocommit != wrapper.autocommit
    if not (open_ or wrapper.in_atomic_block):
        return
    logger.warning(
        "a transaction was left open on this process's database connection (a task interrupted inside "
        "one); rolling it back and reconnecting",
        extra={"action": "interrupted_transaction_discarded"},
    )
    try:
        # Explicitly: a SQLite connection closed while a statement of it is
        # still open lives on until that statement is freed, lock and all.
        raw.rollback()
        wrapper.close()
    except Exception:  # noqa: BLE001 -- the driver's own errors too: whatever failed, a fresh connection follows
        pass
    del connections[DEFAULT_DB_ALIAS]  # a fresh wrapper: the interrupted block's bookkeeping goes with the old one


def _recorded_timeout(soft_limit: Any) -> int | None:
    """A plain call's soft time limit as its row's ``timeout``: whole seconds, rounded up.

    None for no limit, and for one longer than the column holds (``limits.INTEGER_MAX``):
    Celery enforces the message's own limit either way.
    """
    if isinstance(soft_limit, bool) or not isinstance(soft_limit, (int, float)):
        return None
    return math.ceil(soft_limit) if 0 < soft_limit <= limits.INTEGER_MAX else None


# --- the guard -------------------------------------------------------------------------


def _refuse_executions(self: Task, task_id: str, args: Any, kwargs: Any) -> None:
    """An opted-out task's ``before_start``: a message sent for an execution fails it, unrun.

    Such a message comes from a schedule or ``submit()`` made before the task
    opted out; run unguarded, its execution would stay ``queued`` and be sent
    again and again.
    """
    execution_id = (self.request.headers or {}).get(Execution.MESSAGE_HEADER)
    if execution_id is None:
        return
    reason = f"Task {self.name!r} is not guarded (guarded=False): an execution of it cannot be run"
    try:
        named = executions.execution_id_of(execution_id, task=self.name, celery_task_id=task_id)
        executions.fail_unrun(named, task=self.name, celery_task_id=task_id, reason=reason)
    except MessageRefused as refused:
        logger.warning("%s; not failed", refused, extra={"action": "message_refused", "execution_id": execution_id})
    logger.warning("%s (execution %s); not run", reason, execution_id, extra={"action": "unguarded_execution"})
    raise Ignore()


#: What an opted-out task (``guarded=False``) takes back from ``celery.Task``.
_GUARD_ATTRIBUTES = ("acks_late", "reject_on_worker_lost", "Request", "before_start", "__call__", "retry")


class ExecutionTask(Task):
    """The guard: claim once, renew while running, record the outcome.

    Every task of an app made with ``Celery(task_cls=ExecutionTask)``, or one
    task with ``@shared_task(base=ExecutionTask)``. A task of such an app
    opts out with ``@app.task(guarded=False)``: it is then Celery's plain
    ``Task`` (no claim, no record, no hooks in its path).
    """

    acks_late = True
    reject_on_worker_lost = True
    Request = "scheduler.worker.task:GuardedRequest"
    #: ``False`` (``@app.task(guarded=False)``): not guarded, as if its base were ``celery.Task``.
    guarded = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.guarded:
            for name in _GUARD_ATTRIBUTES:
                setattr(cls, name, getattr(Task, name))
            cls.before_start = _refuse_executions  # type: ignore[method-assign]  # one header lookup per task

    # --- claim ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Claim this message's execution, or refuse it with ``Ignore``: a duplicate, or not sent for it."""
        header = (self.request.headers or {}).get(Execution.MESSAGE_HEADER)
        # The pool child's own identity: the main process finds this claim by it (GuardedRequest).
        worker = process_ids.process_id(self.request.hostname, os.getpid())
        try:
            execution_id = (
                None if header is None else executions.execution_id_of(header, task=self.name, celery_task_id=task_id)
            )
            execution, since = self._claim(task_id, args, kwargs, worker=worker, execution_id=execution_id)
        except MessageRefused as refused:
            logger.warning(
                "%s; acknowledged, not run",
                refused,
                extra={"action": "message_refused", "execution_id": refused.execution_id, "reason": refused.reason},
            )
            raise Ignore() from None
        if execution is None:
            logger.warning(
                "duplicate delivery of execution %s (task %s, celery id %s): not run",
                execution_id or executions.ad_hoc_key(task_id),
                self.name,
                task_id,
                extra={"action": "duplicate_delivery", "execution_id": execution_id},
            )
            raise Ignore()
        claim = Claim.of(execution)
        if executions.fail_exhausted(claim):
            raise Ignore()
        setattr(self.request, _ROW_ATTR, execution)
        setattr(self.request, _CLAIM_ATTR, claim)
        logs.bind(execution_id=execution.pk, schedule=execution.schedule_id)
        _renewer.hold(claim, since=since, timeout=execution.timeout)
        if not _renewer.confirm(claim):
            _renewer.drop(claim)
            logger.warning(
                "execution %s attempt %s: this process was paused after claiming it and the claim could not be "
                "confirmed (it moved on, or the database did not answer); not run",
                claim.execution_id,
                claim.attempt,
                extra={"action": "claim_lost_before_body", "execution_id": claim.execution_id},
            )
            raise Ignore()
        start_at = getattr(self.request, _START_ATTR, None)
        if start_at is not None:  # the rate limit's start taken for it: the body begins then, not before
            time.sleep(max(0.0, start_at - time.monotonic()))

    def _claim(
        self, task_id: str, args: Any, kwargs: Any, *, worker: str, execution_id: Any
    ) -> tuple[Execution | None, float]:
        """Claim the execution the message names, or else its ad-hoc one (recorded first), as this message.

        Return it (``None``: not claimed) and the renewer's clock just before
        the claim, which the local deadline counts from so that it never
        outlasts the database's. A retry due within ``EARLY_RETRY_WAIT_SECONDS``
        is waited for and claimed then; one due later is not claimed (a
        duplicate, early).
        """
        if execution_id is not None:
            target: dict[str, Any] = {"execution_id": execution_id}
        else:
            time_limits = self.request.timelimit or (None, None)
            call = {
                "task": self.name,
                "args": args,
                "kwargs": kwargs,
                "queue": (self.request.delivery_info or {}).get("routing_key") or "",
                "timeout": _recorded_timeout(time_limits[1]),
                "now": clock.now(),
            }
            if not _ruled():  # nothing to ask between the record and the claim: both in one statement
                since = _renewer.now()
                execution = _reconnecting(executions.record_ad_hoc_claimed, task_id, worker=worker, **call)
                if execution is not None:
                    setattr(self.request, _START_ATTR, None)
                    setattr(self.request, _PLACE_ATTR, None)
                    return execution, since
            target = {"key": executions.record_ad_hoc(task_id, **call)}
        found = _routing_if_ruled(target)
        place, start_at = None, None
        if found is not None:
            _refuse_if_paused(found)
            start_at = _keep_to_rate(
                found, args, kwargs, self.app, wait_allowed=_rate_wait_allowed(self.request.timelimit)
            )
            place = _place_of(found, args, kwargs)
        setattr(self.request, _START_ATTR, start_at)
        claim = {"worker": worker, "task": self.name, "celery_task_id": task_id, "place": place, **target}
        since = _renewer.now()
        execution = _reconnecting(executions.claim, **claim)
        if execution is None and place is not None:
            _wait_for_place(target, place)
        setattr(self.request, _PLACE_ATTR, place)
        if execution is None:
            due_in = executions.retry_due_in(**target)
            if due_in is not None and due_in <= EARLY_RETRY_WAIT_SECONDS:
                time.sleep(due_in)
                since = _renewer.now()
                execution = _reconnecting(executions.claim, **claim)
        return execution, since

    # --- run and record --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        place: work_rules.Place | None = getattr(self.request, _PLACE_ATTR, None)
        try:
            return self._run_and_record(*args, **kwargs)
        finally:
            if place is not None:  # whatever the outcome, the execution left its place
                _offer_freed_place(self.app, place)

    def _run_and_record(self, *args: Any, **kwargs: Any) -> Any:
        execution: Execution | None = getattr(self.request, _ROW_ATTR, None)
        claim: Claim | None = getattr(self.request, _CLAIM_ATTR, None)
        if execution is None or claim is None:
            # Called directly as a function (or in eager mode): nothing to guard.
            return super().__call__(*args, **kwargs)
        try:
            try:
                with tracing.claim_span("scheduler.run", claim):
                    value = self.run(*args, **kwargs)
            finally:
                # Before any outcome is written: the renewer must not take the
                # claim this attempt ends itself for a lost one and stop the process.
                _renewer.drop(claim)
        except (Retry, _RetryNotSent):
            raise
        except SoftTimeLimitExceeded as exc:
            _discard_interrupted_transaction()  # the limit may have struck inside the body's transaction
            reason = f"Soft time limit of {execution.timeout}s exceeded"
            _write_outcome(
                self, claim, status=Execution.Status.TIMED_OUT, error=reason, traceback_text=_traceback_text(exc)
            )
            raise SoftTimeLimitExceeded(reason) from exc
        except Exception as exc:
            if _connection_lost(exc) and executions.loss_retries_left(claim):
                error = executions.connection_lost_error(claim.attempt)
                logger.warning(
                    "execution %s attempt %s: %s (%s); running it again",
                    *_token(claim),
                    error,
                    _error_text(exc),
                    extra={"action": "connection_lost", "execution_id": claim.execution_id},
                )
                raise self._retry_after_error(claim, exc, CONNECTION_LOST_RETRY_SECONDS, error=error) from exc
            if executions.retries_left(claim):
                delay = policies.retry_delay(
                    claim.attempt,
                    base=execution.retry_backoff,
                    cap=settings.RETRY_BACKOFF_MAX_SECONDS,
                    spread=random.random(),
                )
                raise self._retry_after_error(claim, exc, delay) from exc
            _write_outcome(
                self,
                claim,
                status=Execution.Status.FAILED,
                error=_error_text(exc),
                traceback_text=_traceback_text(exc),
            )
            raise
        finally:
            logs.unbind("execution_id", "schedule")
        failpoint("worker.after_body")
        running: RunningExecution | None = getattr(self.request, _RUNNING_ATTR, None)
        if running is not None and running.succeeded:  # its fenced block recorded the outcome; the result is left
            _reconnecting(executions.record_result, claim, _result_summary(value))
        else:
            row = celery_result.row_of(self, value, using=Execution.objects.db)
            finish = {"status": Execution.Status.SUCCEEDED, "result": _result_summary(value), "celery_row": row}
            recorded = _write_outcome(self, claim, **finish)
            if recorded and row is not None:
                celery_result.check_written(row, Execution.objects.db)
                celery_result.stored(self)
        return value

    def retry(self, *args: Any, exc: BaseException | None = None, **kwargs: Any) -> Retry:
        """Mark the execution ``retrying`` (next attempt), then let Celery re-send the message.

        The row changes first so the re-sent message finds it claimable. A
        task's own ``self.retry()`` comes here: when Celery refuses it (its
        own ``max_retries``), the attempt goes on; when the message cannot be
        sent, as for the guard's retry (``_retry_after_error``).
        """
        claim: Claim | None = getattr(self.request, _CLAIM_ATTR, None)
        if claim is None:
            return super().retry(*args, exc=exc, **kwargs)  # type: ignore[misc, arg-type]  # see below
        since = _renewer.now()
        self._mark_retrying(claim, exc, self._retry_delay(kwargs))
        try:
            failpoint("worker.retry.send")
            # Passed through as received: callers give exc by keyword, and Celery
            # takes any BaseException there (celery-types says Exception).
            return super().retry(*args, exc=exc, **kwargs)  # type: ignore[misc, arg-type]
        except Retry:
            raise
        except Reject as refused:  # Celery could not send the message
            raise _not_sent(claim, refused) from refused
        except BaseException:
            # Celery refused (e.g. its own max_retries): the attempt goes on as running.
            if executions.undo_retry(claim):
                _renewer.hold(claim, since=since, timeout=getattr(self.request, _ROW_ATTR).timeout)
            raise

    def _retry_after_error(self, claim: Claim, exc: Exception, delay: float, *, error: str | None = None) -> Retry:
        """Retry the attempt ``claim`` runs, whose body raised ``exc``, in ``delay`` seconds (the guard's own retry).

        ``error`` is the attempt's recorded error, when not ``exc``'s own text
        (a loss, which does not count against ``max_retries``).

        The row is ``retrying`` before Celery sends anything, so whatever
        happens to the message the attempt has ended: a message that could
        not be sent (the broker is down) leaves it ``retrying``, due at its
        time, for the leader to send (``reconcile``), never ``running``
        without a body.
        """
        self._mark_retrying(claim, exc, delay, error=error)
        try:
            failpoint("worker.retry.send")
            # Celery's own count would refuse a loss's retry past max_retries: the row counts them (above).
            return super().retry(exc=exc, countdown=delay, max_retries=self.request.retries + 1)
        except Retry:
            raise
        except Exception as refused:
            raise _not_sent(claim, refused) from refused

    def _mark_retrying(
        self, claim: Claim, exc: BaseException | None, delay: float, *, error: str | None = None
    ) -> None:
        """End the attempt ``claim`` runs as ``retrying``, due in ``delay`` seconds; ``Ignore`` if the claim moved on."""
        _renewer.drop(claim)  # the attempt ends here (see __call__)
        marked = _reconnecting(
            executions.retry,
            claim,
            delay_seconds=delay,
            error=error if error is not None else _error_text(exc) if exc else "",
            traceback_text=_traceback_text(exc) if exc else "",
        )
        if not marked:
            logger.warning("execution %s attempt %s: the claim moved on; not retrying it here", *_token(claim))
            raise Ignore()

    def _retry_delay(self, options: dict[str, Any]) -> float:
        """Return the seconds until the retry Celery sends with ``options`` is due, as ``Task.retry`` works it out."""
        eta, countdown = options.get("eta"), options.get("countdown")
        if eta is not None:  # a naive one is UTC, the app's time zone
            aware = eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
            return max(0.0, (aware - clock.now()).total_seconds())
        return float(self.default_retry_delay if countdown is None else countdown)


T = TypeVar("T")


def _reconnecting(write: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one write of the guard; if the server dropped this process's connection, reconnect and run it once more.

    A database restart or ``pg_terminate_backend`` must not cost a finished
    body its outcome. Running the write again is safe: every write of a
    claim holder matches on its attempt, so one that did commit the first
    time changes nothing the second.
    """
    try:
        return write(*args, **kwargs)
    except DatabaseError as exc:
        # The server ending the session (an idle-in-transaction timeout) is an InternalError.
        if not (isinstance(exc, (InterfaceError, OperationalError)) or _connection_lost(exc)):
            raise
        logger.warning("database connection lost during %s; reconnecting once", write.__name__)
        connection.close()
        return write(*args, **kwargs)


#: SQLSTATEs of a session the server ended: class 08 (connection exception) and these.
_SESSION_ENDED_STATES = ("57P01", "57P02", "57P03", "57P05", "25P03")  # shutdowns, idle timeouts


def _connection_lost(exc: BaseException) -> bool:
    """Return whether ``exc`` came from the server dropping this process's database connection.

    A body cut off from its database (``pg_terminate_backend``, a server
    restart, an idle timeout, a cut network) did not fail: its open
    transaction, a fenced block's too, rolled back, so it is run again as a
    lost attempt. A database error on a session that goes on (a constraint,
    a deadlock, a statement timeout) is the task's own.
    """
    errors: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in errors:
        errors.append(cause)
        cause = cause.__cause__ or cause.__context__
    for error in errors:
        state = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if isinstance(state, str) and (state.startswith("08") or state in _SESSION_ENDED_STATES):
            return True
    if not any(isinstance(error, (InterfaceError, OperationalError)) for error in errors):
        return False
    # The client noticed first ("server closed the connection unexpectedly"): no SQLSTATE, a closed connection.
    raw = connection.connection
    return raw is None or bool(getattr(raw, "closed", False))


def _token(claim: Claim) -> tuple[int, int]:
    return claim.execution_id, claim.attempt


def _not_sent(claim: Claim, error: BaseException) -> _RetryNotSent:
    """Log that the retry of ``claim``'s execution could not be sent; return what rejects its message.

    The execution is ``retrying`` already, due at its time, and this process
    holds no claim on it: the leader sends it (its broker check, once a
    restarted broker answers; else reconcile, ``RECONCILE_QUEUED_AFTER_SECONDS``
    after it was due). The message is acknowledged, as done with.
    """
    reason = getattr(error, "reason", None) or error
    logger.warning(
        "execution %s attempt %s: its retry could not be sent (%s); it stays retrying for the leader to send",
        *_token(claim),
        reason,
        extra={"action": "retry_not_sent", "execution_id": claim.execution_id},
    )
    return _RetryNotSent(reason)


class GuardedRequest(Request):
    """Celery's worker-side request: acts for a pool child that died or hit its hard time limit.

    These hooks run in the worker's main process, which never sees the
    child's ``Claim`` (prefork: ``before_start`` ran in the child, and
    nothing flows back from it but the result). What the main process does
    know is which child ran the job (``worker_pid``, set when the child
    accepted it), and the child wrote ``<hostname>:<pid>`` into the row's
    ``worker`` with its claim. So the claim acted on is the one held under
    that identity, read with its attempt, and the write is fenced by that
    attempt: a successor's claim (another worker, or a later attempt) is
    never touched, even when it reuses this message's Celery task id.
    Matching the task id instead would let a stale attempt's time limit or
    lost child write over its successor's row (issue 15). For the same
    reason a stale attempt's hard time limit reports nothing to Celery: no
    result, no errback, no ``task_failure``.
    """

    def _child_claim(self) -> Claim | None:
        if self.worker_pid is None:  # never reached a pool child: it claimed nothing
            return None
        worker = process_ids.process_id(self.hostname, self.worker_pid)
        header = (self.request_dict or {}).get(Execution.MESSAGE_HEADER)
        if header is not None:
            execution_id = executions.valid_execution_id(header)  # another is refused before any claim
            return None if execution_id is None else executions.held_by(worker=worker, execution_id=execution_id)
        return executions.held_by(worker=worker, key=executions.ad_hoc_key(self.id))

    #: A hard time limit was handled (Celery reports it twice: as the job's failure, then as its timeout).
    _hard_limit_handled = False
    #: It struck a child whose claim had moved on: this message has no outcome to report.
    _outcome_elsewhere = False

    def _hard_limit_struck(self, timeout: float) -> None:
        """Record the hard time limit as ``timed_out``, or note that the claim moved on (Celery kills the child)."""
        if self._hard_limit_handled:
            return
        self._hard_limit_handled = True
        try:
            claim = self._child_claim()
            if claim is None:
                self._outcome_elsewhere = True
                logger.warning(
                    "task %s hit its hard time limit after its claim moved on; its outcome is its successor's",
                    self.id,
                    extra={"action": "stale_hard_limit"},
                )
                return
            executions.finish(
                claim,
                status=Execution.Status.TIMED_OUT,
                error=f"Hard time limit of {timeout}s exceeded; the worker process was killed",
            )
        except DatabaseError:
            logger.exception("could not record the hard time limit of task %s", self.id)

    def _end_stale_attempt(self) -> None:
        # The task id is the successor's too (a re-send reuses it): Celery's
        # failure handling would store a FAILURE over the successor's result
        # and fire the errbacks and task_failure for an execution still
        # running. The message is done with; nothing else is reported.
        task_ready(self)
        self.acknowledge()

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._hard_limit_struck(timeout)
            if self._outcome_elsewhere:
                return self._end_stale_attempt()
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        if isinstance(exc, TimeLimitExceeded) and not return_ok:  # the pool's, before on_timeout
            self._hard_limit_struck(exc.args[0] if exc.args else 0.0)
            if self._outcome_elsewhere:
                return self._end_stale_attempt()
        if isinstance(exc, WorkerLostError) and self.task.reject_on_worker_lost:
            # The child is gone for sure: let the requeued message claim the
            # execution at once instead of waiting for its claim to expire.
            try:
                claim = self._child_claim()
                if claim is not None:
                    executions.release(claim)
            except DatabaseError:
                logger.exception("could not release the claim of lost task %s", self.id)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

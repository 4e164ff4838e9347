"""ExecutionTask: the guard every task of the project's Celery app runs under.

Before a task body runs, the worker claims its Execution row with one
conditional UPDATE. When nothing is claimed, the message is a duplicate
delivery (the execution is already running elsewhere, or done): it is
acknowledged, logged and not run. While the body runs, one thread per worker
process renews the execution leases of what that process runs, in one UPDATE
per interval; a worker that dies stops renewing, and once its lease expires
the execution may be claimed again. The outcome and the schedule's counters
are written in one transaction.

A task called the plain Celery way (no execution id in the message) is
recorded as an ad-hoc Execution keyed by its Celery task id, so a redelivery
of that message is deduplicated the same way.

Time limits come from the execution's ``timeout``: the soft limit raises
``SoftTimeLimitExceeded`` inside the task (recorded ``timed_out``), the hard
limit ``TIMEOUT_GRACE_SECONDS`` later kills the pool child (recorded
``timed_out`` by ``on_failure``, which Celery calls in the worker's main
process). Only the prefork pool (Celery's default) enforces both; with the
``solo`` and ``threads`` pools a task runs past its timeout. No timeout means
no limit. Timed-out executions are final; they are not retried.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import traceback
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from celery import Task, current_task
from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request
from django.db import DatabaseError, close_old_connections, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Now

from scheduler import clock, dbclock, logs, policies
from scheduler.conf import settings
from scheduler.models import Execution, Schedule

logger = logging.getLogger(__name__)

#: Attribute of the Celery request context that holds the claimed Execution.
_REQUEST_ATTR = "scheduler_execution"
#: Results longer than this (as JSON) are stored truncated.
RESULT_SUMMARY_MAX_CHARS = 10_000
#: Statuses of an execution no worker has started yet.
_WAITING = (Execution.Status.PENDING, Execution.Status.QUEUED, Execution.Status.RETRYING)


def current_execution() -> Execution | None:
    """Return the Execution the calling task is running, or ``None`` outside one."""
    task = current_task
    if not task:
        return None
    return getattr(task.request, _REQUEST_ATTR, None)


def _db_now_plus(seconds: float) -> ExpressionWrapper:
    """The database clock plus ``seconds``, as an expression (no local clock involved)."""
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())


def _result_summary(value: Any) -> Any:
    """Return ``value`` if it is small JSON, else a bounded description of it."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return {"repr": repr(value)[:1000]}
    if len(text) > RESULT_SUMMARY_MAX_CHARS:
        return {"truncated": text[:1000], "length": len(text)}
    return value


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- execution leases ----------------------------------------------------------------


class _LeaseRenewer:
    """Renews the execution leases of one worker process, one UPDATE per interval."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._pid: int | None = None

    def hold(self, execution_id: int) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use in this (possibly forked) process
                self._held.clear()
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="execution-lease-renewer", daemon=True).start()
            self._held.add(execution_id)

    def drop(self, execution_id: int) -> None:
        with self._lock:
            self._held.discard(execution_id)

    def _run(self) -> None:
        stop = threading.Event()
        while not stop.wait(settings.EXECUTION_RENEW_SECONDS):
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                Execution.objects.filter(id__in=held, status=Execution.Status.RUNNING).update(
                    lease_expires_at=_db_now_plus(settings.EXECUTION_LEASE_SECONDS)
                )
            except DatabaseError:
                logger.exception("could not renew execution leases %s; trying again", held)
                close_old_connections()


_renewer = _LeaseRenewer()


# --- the guard -------------------------------------------------------------------------


def _claim(column: str, value: int | str, *, worker: str, task_id: str) -> Execution | None:
    """Move the execution to ``running`` for ``worker`` in one conditional UPDATE; return it.

    Same condition as ``Execution.objects.claimable()``, on the database
    clock. A running row claimed again belongs to a dead worker, so the
    claim counts a new attempt. ``None`` means nothing was claimable.
    """
    assert column in {"id", "idempotency_key"}
    now, plus = dbclock.now_sql(), dbclock.now_plus_sql()
    status = Execution.Status
    sql = (
        f"UPDATE scheduler_execution SET status = %s, worker = %s, celery_task_id = %s, "
        f"started_at = {now}, finished_at = NULL, lease_expires_at = {plus}, "
        f"attempt = CASE WHEN status = %s THEN attempt + 1 ELSE attempt END "
        f"WHERE {column} = %s AND (status IN (%s, %s, %s) OR (status = %s AND lease_expires_at < {now})) "
        f"RETURNING *"
    )
    params = [
        status.RUNNING, worker, task_id, dbclock.seconds_param(settings.EXECUTION_LEASE_SECONDS), status.RUNNING,
        value, status.PENDING, status.QUEUED, status.RETRYING, status.RUNNING,
    ]
    return next(iter(Execution.objects.raw(sql, params)), None)


def _finish(
    execution: Execution,
    *,
    status: str,
    result: Any = None,
    error: str = "",
    traceback_text: str = "",
) -> bool:
    """Record the final outcome of ``execution`` as claimed; update its schedule's counters.

    Returns False (and writes nothing) when the claim no longer holds, e.g.
    another worker took the execution over after this one's lease expired.
    """
    claim = Execution.objects.filter(pk=execution.pk, worker=execution.worker, status=Execution.Status.RUNNING)
    finished = _record_outcome(
        claim, execution, status=status, result=result, error=error, traceback_text=traceback_text
    )
    if not finished:
        logger.warning(
            "execution %s was taken over by another worker; its outcome here (%s) is not recorded",
            execution.pk, status, extra={"action": "claim_lost", "execution_id": execution.pk},
        )
    return finished


def fail_unrun(execution_id: int, *, reason: str) -> bool:
    """Record a waiting execution ``failed`` with ``reason`` without running it; count it on its schedule.

    Only a ``pending``, ``queued`` or ``retrying`` row changes: one that runs
    or has finished keeps its status. Returns whether the row changed.
    """
    execution = Execution.objects.filter(pk=execution_id).only("pk", "schedule_id", "started_at").first()
    if execution is None:
        return False
    waiting = Execution.objects.filter(pk=execution_id, status__in=_WAITING)
    return _record_outcome(waiting, execution, status=Execution.Status.FAILED, error=reason)


def _record_outcome(
    rows: QuerySet[Execution], execution: Execution, *, status: str, result: Any = None, error: str = "",
    traceback_text: str = "",
) -> bool:
    """Write the outcome onto ``rows`` (the conditional match on ``execution``); count it when written."""
    # One statement when there is no schedule to update: the common ad-hoc path stays cheap.
    with transaction.atomic() if execution.schedule_id is not None else nullcontext():
        finished = rows.update(
            status=status,
            finished_at=Now(),
            lease_expires_at=None,
            result=result,
            error=error,
            traceback=traceback_text,
        )
        if finished and execution.schedule_id is not None:
            count_run(execution, status=status, error=error)
    return bool(finished)


def count_run(execution: Execution, *, status: str, error: str) -> None:
    """Update the schedule's run counters; trip its circuit breaker when due."""
    schedule = Schedule.objects.select_for_update().filter(pk=execution.schedule_id).first()
    if schedule is None:
        return
    if execution.started_at is not None:  # an execution failed before it started leaves the last run as it was
        schedule.last_run_at = execution.started_at
    schedule.last_status = status
    schedule.total_runs += 1
    if status == Execution.Status.SUCCEEDED:
        schedule.consecutive_failures = 0
    else:
        schedule.consecutive_failures += 1
        schedule.last_error = error
        limit = schedule.pause_after_failures
        if limit and schedule.consecutive_failures >= limit and not schedule.is_paused:
            schedule.paused_reason = f"Paused after {schedule.consecutive_failures} consecutive failures; last: {error}"
            logger.warning(
                "schedule %s paused: %s", schedule.name, schedule.paused_reason,
                extra={"action": "schedule_paused", "schedule": schedule.name},
            )
    schedule.save(
        update_fields=[
            "last_run_at", "last_status", "total_runs", "consecutive_failures", "last_error", "paused_reason", "updated_at"
        ]
    )


class ExecutionTask(Task):
    """Base class of every task: claim once, renew while running, record the outcome."""

    acks_late = True
    reject_on_worker_lost = True
    Request = "scheduler.worker:GuardedRequest"

    # --- claim ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Claim this message's execution, or refuse a duplicate delivery with ``Ignore``."""
        execution_id = (self.request.headers or {}).get(Execution.MESSAGE_HEADER)
        if execution_id is not None:
            execution = _claim("id", execution_id, worker=self._worker_identity(), task_id=task_id)
        else:
            key = self._record_ad_hoc(task_id, args, kwargs)
            execution = _claim("idempotency_key", key, worker=self._worker_identity(), task_id=task_id)
        if execution is None:
            logger.warning(
                "duplicate delivery of execution %s (task %s, celery id %s): not run",
                execution_id or f"celery:{task_id}", self.name, task_id,
                extra={"action": "duplicate_delivery", "execution_id": execution_id},
            )
            raise Ignore()
        if execution.attempt > execution.max_retries + 1:
            reason = f"Worker lost during attempt {execution.attempt - 1}; no retries left"
            _finish(execution, status=Execution.Status.FAILED, error=reason)
            logger.error(
                "execution %s failed: %s", execution.pk, reason,
                extra={"action": "execution_failed", "execution_id": execution.pk},
            )
            raise Ignore()
        setattr(self.request, _REQUEST_ATTR, execution)
        logs.bind(execution_id=execution.pk, schedule=execution.schedule_id)
        _renewer.hold(execution.pk)

    def _record_ad_hoc(self, task_id: str, args: Any, kwargs: Any) -> str:
        """Record a plain Celery call as an Execution keyed by its task id; return the key."""
        key = f"celery:{task_id}"
        limits = self.request.timelimit or (None, None)
        Execution.objects.bulk_create(
            [
                Execution(
                    idempotency_key=key,
                    task=self.name,
                    args=list(args or ()),
                    kwargs=dict(kwargs or {}),
                    queue=(self.request.delivery_info or {}).get("routing_key") or "",
                    scheduled_for=clock.now(),
                    status=Execution.Status.QUEUED,
                    celery_task_id=task_id,
                    timeout=int(limits[1]) if limits[1] else None,
                )
            ],
            ignore_conflicts=True,
        )
        return key

    def _worker_identity(self) -> str:
        return f"{self.request.hostname}:{os.getpid()}"

    # --- run and record --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        execution: Execution | None = getattr(self.request, _REQUEST_ATTR, None)
        if execution is None:
            # Called directly as a function (or in eager mode): nothing to guard.
            return super().__call__(*args, **kwargs)
        try:
            value = self.run(*args, **kwargs)
        except Retry:
            raise
        except SoftTimeLimitExceeded as exc:
            reason = f"Soft time limit of {execution.timeout}s exceeded"
            _finish(execution, status=Execution.Status.TIMED_OUT, error=reason, traceback_text=traceback.format_exc())
            raise SoftTimeLimitExceeded(reason) from exc
        except Exception as exc:
            if execution.attempt <= execution.max_retries:
                delay = policies.retry_delay(
                    execution.attempt,
                    base=execution.retry_backoff,
                    cap=settings.RETRY_BACKOFF_MAX_SECONDS,
                    spread=random.random(),
                )
                raise self.retry(exc=exc, countdown=delay, max_retries=execution.max_retries) from exc
            _finish(execution, status=Execution.Status.FAILED, error=_error_text(exc), traceback_text=traceback.format_exc())
            raise
        finally:
            _renewer.drop(execution.pk)
            logs.unbind("execution_id", "schedule")
        _finish(execution, status=Execution.Status.SUCCEEDED, result=_result_summary(value))
        return value

    def retry(self, *args: Any, exc: BaseException | None = None, **kwargs: Any) -> Retry:
        """Mark the execution ``retrying`` (next attempt), then let Celery re-send the message.

        The row changes first so the re-sent message finds it claimable.
        """
        execution: Execution | None = getattr(self.request, _REQUEST_ATTR, None)
        if execution is None:
            return super().retry(*args, exc=exc, **kwargs)
        claim = Execution.objects.filter(pk=execution.pk, worker=execution.worker, status=Execution.Status.RUNNING)
        marked = claim.update(
            status=Execution.Status.RETRYING,
            attempt=F("attempt") + 1,
            lease_expires_at=None,
            # When the retry is due: reconcile sends it again if nobody claims it by then.
            enqueued_at=_db_now_plus(float(kwargs.get("countdown") or 0)),
            error=_error_text(exc) if exc else "",
            traceback="".join(traceback.format_exception(exc)) if exc else "",
        )
        if not marked:
            logger.warning("execution %s was taken over; not retrying it here", execution.pk)
            raise Ignore()
        try:
            return super().retry(*args, exc=exc, **kwargs)
        except Retry:
            raise
        except BaseException:
            # Celery refused (e.g. its own max_retries): the attempt goes on as running.
            Execution.objects.filter(pk=execution.pk, status=Execution.Status.RETRYING).update(
                status=Execution.Status.RUNNING, attempt=F("attempt") - 1
            )
            raise

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """Record a hard time limit, which Celery reports here from the worker's main process."""
        if isinstance(exc, TimeLimitExceeded):
            execution = Execution.objects.filter(celery_task_id=task_id, status=Execution.Status.RUNNING).first()
            if execution is not None:
                limit = exc.args[0] if exc.args else "?"
                _finish(
                    execution,
                    status=Execution.Status.TIMED_OUT,
                    error=f"Hard time limit of {limit}s exceeded; the worker process was killed",
                )


class GuardedRequest(Request):
    """Celery's worker-side request, releasing the execution lease when the pool child dies."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        if isinstance(exc, WorkerLostError) and self.task.reject_on_worker_lost:
            # The child is gone for sure: let the requeued message claim the
            # execution at once instead of waiting for its lease to expire.
            try:
                Execution.objects.filter(celery_task_id=self.id, status=Execution.Status.RUNNING).update(
                    lease_expires_at=_db_now_plus(-1)
                )
            except DatabaseError:
                logger.exception("could not release the execution lease of lost task %s", self.id)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

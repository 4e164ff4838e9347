"""ExecutionTask: the guard every task of the project's Celery app runs under.

Before a task body runs, the worker claims its Execution row with one
conditional UPDATE. When nothing is claimed, the message is a duplicate
delivery (the execution is already running elsewhere, or done): it is
acknowledged, logged and not run. While the body runs, one thread per worker
process renews the claims of what that process runs, in one UPDATE per
interval; a worker that dies stops renewing, and once its claim expires the
execution may be claimed again, as the next attempt. Every write after the
claim is fenced by that attempt (see ``scheduler.executions``, which owns
every status change; this module holds only Celery's hooks). The outcome and
the schedule's counters are written in one transaction.

A task called the plain Celery way (no execution id in the message) is
recorded as an ad-hoc Execution keyed by its Celery task id, so a redelivery
of that message is deduplicated the same way.

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
import os
import random
import threading
import traceback
from typing import Any

from celery import Task, current_task
from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded, WorkerLostError
from celery.worker.request import Request
from django.db import DatabaseError, close_old_connections

from scheduler import clock, executions, logs, policies
from scheduler.conf import settings
from scheduler.executions import Claim
from scheduler.models import Execution

logger = logging.getLogger(__name__)

#: Attribute of the Celery request context that holds the claimed Execution.
_REQUEST_ATTR = "scheduler_execution"
#: Attribute of the Celery request context that holds the ``Claim`` (the fencing token).
_CLAIM_ATTR = "scheduler_claim"
#: Results longer than this (as JSON) are stored truncated.
RESULT_SUMMARY_MAX_CHARS = 10_000


def current_execution() -> Execution | None:
    """Return the Execution the calling task is running, or ``None`` outside one."""
    task = current_task
    if not task:
        return None
    return getattr(task.request, _REQUEST_ATTR, None)


def current_claim() -> Claim | None:
    """Return the ``Claim`` the calling task runs under (its fencing token), or ``None`` outside one."""
    task = current_task
    if not task:
        return None
    return getattr(task.request, _CLAIM_ATTR, None)


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



# --- claims ----------------------------------------------------------------------------


class _ClaimRenewer:
    """Renews the claims of one worker process, one UPDATE per interval."""

    def __init__(self) -> None:
        self._held: set[Claim] = set()
        self._lock = threading.Lock()
        self._pid: int | None = None

    def hold(self, claim: Claim) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use in this (possibly forked) process
                self._held.clear()
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="claim-renewer", daemon=True).start()
            self._held.add(claim)

    def drop(self, claim: Claim) -> None:
        with self._lock:
            self._held.discard(claim)

    def _run(self) -> None:
        stop = threading.Event()
        while not stop.wait(settings.CLAIM_RENEW_SECONDS):
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                executions.renew(held, seconds=settings.CLAIM_SECONDS)
            except DatabaseError:
                ids = [claim.execution_id for claim in held]
                logger.exception("could not renew the claims on executions %s; trying again", ids)
                close_old_connections()


_renewer = _ClaimRenewer()


# --- the guard -------------------------------------------------------------------------


class ExecutionTask(Task):
    """Base class of every task: claim once, renew while running, record the outcome."""

    acks_late = True
    reject_on_worker_lost = True
    Request = "scheduler.worker:GuardedRequest"

    # --- claim ---------------------------------------------------------------------

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Claim this message's execution, or refuse a duplicate delivery with ``Ignore``."""
        execution_id = (self.request.headers or {}).get(Execution.MESSAGE_HEADER)
        # The pool child's own identity: the main process finds this claim by it (GuardedRequest).
        worker = executions.worker_identity(self.request.hostname, os.getpid())
        if execution_id is not None:
            execution = executions.claim(worker=worker, celery_task_id=task_id, execution_id=execution_id)
        else:
            limits = self.request.timelimit or (None, None)
            key = executions.record_ad_hoc(
                task_id,
                task=self.name,
                args=args,
                kwargs=kwargs,
                queue=(self.request.delivery_info or {}).get("routing_key") or "",
                timeout=int(limits[1]) if limits[1] else None,
                now=clock.now(),
            )
            execution = executions.claim(worker=worker, celery_task_id=task_id, key=key)
        if execution is None:
            logger.warning(
                "duplicate delivery of execution %s (task %s, celery id %s): not run",
                execution_id or executions.ad_hoc_key(task_id), self.name, task_id,
                extra={"action": "duplicate_delivery", "execution_id": execution_id},
            )
            raise Ignore()
        claim = Claim.of(execution)
        if executions.fail_exhausted(claim):
            raise Ignore()
        setattr(self.request, _REQUEST_ATTR, execution)
        setattr(self.request, _CLAIM_ATTR, claim)
        logs.bind(execution_id=execution.pk, schedule=execution.schedule_id)
        _renewer.hold(claim)

    # --- run and record --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        execution: Execution | None = getattr(self.request, _REQUEST_ATTR, None)
        claim: Claim | None = getattr(self.request, _CLAIM_ATTR, None)
        if execution is None or claim is None:
            # Called directly as a function (or in eager mode): nothing to guard.
            return super().__call__(*args, **kwargs)
        try:
            value = self.run(*args, **kwargs)
        except Retry:
            raise
        except SoftTimeLimitExceeded as exc:
            reason = f"Soft time limit of {execution.timeout}s exceeded"
            executions.finish(
                claim, status=Execution.Status.TIMED_OUT, error=reason, traceback_text=traceback.format_exc()
            )
            raise SoftTimeLimitExceeded(reason) from exc
        except Exception as exc:
            if executions.retries_left(claim.attempt, claim.max_retries):
                delay = policies.retry_delay(
                    claim.attempt,
                    base=execution.retry_backoff,
                    cap=settings.RETRY_BACKOFF_MAX_SECONDS,
                    spread=random.random(),
                )
                raise self.retry(exc=exc, countdown=delay, max_retries=claim.max_retries) from exc
            executions.finish(
                claim, status=Execution.Status.FAILED, error=_error_text(exc), traceback_text=traceback.format_exc()
            )
            raise
        finally:
            _renewer.drop(claim)
            logs.unbind("execution_id", "schedule")
        executions.finish(claim, status=Execution.Status.SUCCEEDED, result=_result_summary(value))
        return value

    def retry(self, *args: Any, exc: BaseException | None = None, **kwargs: Any) -> Retry:
        """Mark the execution ``retrying`` (next attempt), then let Celery re-send the message.

        The row changes first so the re-sent message finds it claimable.
        """
        claim: Claim | None = getattr(self.request, _CLAIM_ATTR, None)
        if claim is None:
            return super().retry(*args, exc=exc, **kwargs)
        marked = executions.retry(
            claim,
            delay_seconds=float(kwargs.get("countdown") or 0),
            error=_error_text(exc) if exc else "",
            traceback_text="".join(traceback.format_exception(exc)) if exc else "",
        )
        if not marked:
            logger.warning("execution %s attempt %s: the claim moved on; not retrying it here", *_token(claim))
            raise Ignore()
        try:
            return super().retry(*args, exc=exc, **kwargs)
        except Retry:
            raise
        except BaseException:
            # Celery refused (e.g. its own max_retries): the attempt goes on as running.
            executions.undo_retry(claim)
            raise


def _token(claim: Claim) -> tuple[int, int]:
    return claim.execution_id, claim.attempt


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
    lost child write over its successor's row (issue 15).
    """

    def _child_claim(self) -> Claim | None:
        if self.worker_pid is None:  # never reached a pool child: it claimed nothing
            return None
        worker = executions.worker_identity(self.hostname, self.worker_pid)
        execution_id = (self.request_dict or {}).get(Execution.MESSAGE_HEADER)
        if execution_id is not None:
            return executions.held_by(worker=worker, execution_id=execution_id)
        return executions.held_by(worker=worker, key=executions.ad_hoc_key(self.id))

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """Record a hard time limit as ``timed_out`` (Celery kills the child right after)."""
        if not soft:
            try:
                claim = self._child_claim()
                if claim is not None:
                    executions.finish(
                        claim,
                        status=Execution.Status.TIMED_OUT,
                        error=f"Hard time limit of {timeout}s exceeded; the worker process was killed",
                    )
            except DatabaseError:
                logger.exception("could not record the hard time limit of task %s", self.id)
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
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

"""Celery signal receivers: a worker's start, heartbeat and watch, messages refused or expired.

A worker whose node name no row can hold (every claim and heartbeat names
the process by it) stops at its start, in one line.

The heartbeat thread (``scheduler.worker.heartbeat``) starts when the worker is
ready and stops when it shuts down; it writes only after the worker's own
consumer received the probe it sent through the broker. The watch thread
(``scheduler.ops.watch.Watcher``) starts and stops with it.

A message whose task the worker does not know, or cannot accept, is
rejected by Celery without a requeue: no worker would ever claim its
execution, and reconcile would re-send it forever. The receivers below
record such an execution ``failed`` with the reason instead, if the message
was sent for it (its task name and task id are the execution's); another
message that names it is refused, logged and counted, as the claim does.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery.signals import task_rejected, task_revoked, task_unknown, worker_init, worker_ready, worker_shutdown
from django.db import DatabaseError, close_old_connections

from scheduler import checks, process_ids
from scheduler.exceptions import MessageRefused
from scheduler.models import Execution
from scheduler.ops import watch
from scheduler.owners import instances
from scheduler.owners.executions import cancel_expired, execution_id_of, fail_unrun
from scheduler.worker import heartbeat

logger = logging.getLogger(__name__)

_heartbeat: heartbeat.Heartbeat | None = None
_watcher: watch.Watcher | None = None


@worker_init.connect(dispatch_uid="scheduler.checks_pass")
def refuse_settings_the_checks_refuse(sender: Any = None, **kwargs: Any) -> None:
    checks.refuse_to_start_on_errors("worker")


@worker_init.connect(dispatch_uid="scheduler.node_name_fits")
def refuse_a_node_name_no_row_holds(sender: Any = None, **kwargs: Any) -> None:
    # Each claim and heartbeat would fail on PostgreSQL (SQLite would store it), and no task would run.
    nodename = str(getattr(sender, "hostname", "") or "")
    allowed = process_ids.MAX_LENGTH - len(process_ids.process_id("", process_ids.MAX_PID))
    if len(nodename) > allowed:
        raise SystemExit(
            f"scheduler: the worker's node name is {len(nodename)} characters long; at most {allowed} fit in the "
            "rows that name a process (celery worker -n)"
        )


@worker_ready.connect(dispatch_uid="scheduler.worker_heartbeat")
def start_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    global _heartbeat, _watcher
    _heartbeat = heartbeat.Heartbeat(sender.app, getattr(sender, "hostname", "") or "")
    _heartbeat.start()
    _watcher = watch.Watcher()
    _watcher.start()


@worker_shutdown.connect(dispatch_uid="scheduler.worker_heartbeat_stop")
def stop_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    if _watcher is not None:
        _watcher.stop(timeout=2.0)
    if _heartbeat is not None:
        # So that it does not write the row again after it is deleted below.
        _heartbeat.stop(timeout=2.0)
    try:
        instances.remove(heartbeat.instance_id(getattr(sender, "hostname", "") or ""))
    except DatabaseError:
        pass  # reconcile removes stale instances


# --- messages a worker refused --------------------------------------------------------
# Both signals are sent in the worker's main (consumer) process, after Celery
# rejected the message. ``message.headers`` is None for a message that is not
# a task message at all; it then names no execution.


@task_unknown.connect(dispatch_uid="scheduler.fail_unknown_task")
def fail_unknown_task(sender: Any = None, message: Any = None, name: str = "", **kwargs: Any) -> None:
    # Trade-off: in a cluster whose workers register different tasks, another
    # worker might know this one. But Celery has already dropped the message
    # (rejected without requeue), so only reconcile's re-send every
    # RECONCILE_QUEUED_AFTER_SECONDS could reach such a worker, by luck of
    # the draw. Failing at once, with the reason, is what the operator needs:
    # route the task to a queue only its workers consume, then retry it.
    hostname = getattr(sender, "hostname", None) or socket.gethostname()
    _fail_refused(message, f"Unknown task: no worker has task {name!r} registered ({hostname} refused the message)")


@task_rejected.connect(dispatch_uid="scheduler.fail_rejected_message")
def fail_rejected_message(
    sender: Any = None, message: Any = None, exc: BaseException | None = None, **kwargs: Any
) -> None:
    hostname = getattr(sender, "hostname", None) or socket.gethostname()
    detail = f"{type(exc).__name__}: {exc}" if exc is not None else "not a task message"
    _fail_refused(message, f"The worker {hostname} rejected the message: {detail}")


def _fail_refused(message: Any, reason: str) -> None:
    headers = getattr(message, "headers", None) or {}
    execution_id = headers.get(Execution.MESSAGE_HEADER)
    if execution_id is None:
        return  # a plain Celery call: no execution was recorded for it
    # The main process may have been idle for hours: drop a connection past its age first.
    close_old_connections()
    try:
        # Only the message sent for the execution may fail it: its task name and task id must be the row's.
        task, celery_task_id = str(headers.get("task") or ""), str(headers.get("id") or "")
        named = execution_id_of(execution_id, task=task, celery_task_id=celery_task_id)
        failed = fail_unrun(named, task=task, celery_task_id=celery_task_id, reason=reason)
    except MessageRefused as refused:
        logger.warning(
            "%s; not failed",
            refused,
            extra={"action": "message_refused", "execution_id": refused.execution_id, "reason": refused.reason},
        )
        return
    except DatabaseError:
        # The row stays waiting; reconcile re-sends it and the next refusal records it.
        logger.exception("could not record execution %s as failed: %s", execution_id, reason)
        return
    if failed:
        logger.error(
            "execution %s failed: %s",
            execution_id,
            reason,
            extra={"action": "execution_failed", "execution_id": execution_id},
        )


# --- messages that expired ---------------------------------------------------------------
# A schedule's ``expires`` becomes its messages' expiry: a worker that gets one
# too late does not run it and sends ``task_revoked`` with ``expired``. Left
# waiting, its execution would be sent again by reconcile, and expire again.

#: Why an execution whose message expired was not run.
EXPIRED_REASON = "Its message expired before a worker started it (the schedule's expires)"


@task_revoked.connect(dispatch_uid="scheduler.cancel_expired")
def cancel_expired_message(sender: Any = None, request: Any = None, expired: bool = False, **kwargs: Any) -> None:
    if not expired or request is None:
        return
    execution_id = getattr(request, Execution.MESSAGE_HEADER, None) or (getattr(request, "headers", None) or {}).get(
        Execution.MESSAGE_HEADER
    )
    if execution_id is None:
        return  # a plain Celery call
    close_old_connections()
    task, celery_task_id = str(getattr(sender, "name", "") or ""), str(getattr(request, "id", "") or "")
    try:
        named = execution_id_of(execution_id, task=task, celery_task_id=celery_task_id)
        cancel_expired(named, task=task, celery_task_id=celery_task_id, reason=EXPIRED_REASON)
    except MessageRefused as refused:
        logger.warning("%s; not cancelled", refused, extra={"action": "message_refused", "reason": refused.reason})
    except DatabaseError:
        # The row stays waiting; reconcile sends it again, and its expiry cancels it then.
        logger.exception("an expired execution was not recorded cancelled", extra={"action": "expired_not_recorded"})

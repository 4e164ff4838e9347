"""Ad-hoc work: ``submit()`` records one Execution and sends it once the caller's transaction commits.

This is ``scheduler.submit``, the public entry point (the package resolves
that name here). The module is not called ``submit``: importing a submodule
sets it as an attribute of its package, and ``scheduler.submit`` would then
be this module instead of the function.

A submission is checked before anything is written, and it is recorded
once per idempotency key. Its message goes through the outbox: a broker
that is down leaves the execution ``pending`` for the beat leader to send,
and ``submit()`` still returns it.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from celery import current_app
from django.db import transaction

from scheduler import dbclock, limits, outbox, task_policy
from scheduler.exceptions import BrokerUnavailable, SubmissionInvalid
from scheduler.models import Execution
from scheduler.models.schedule import LATEST
from scheduler.owners import executions

if TYPE_CHECKING:
    from celery import Celery, Task

logger = logging.getLogger(__name__)

#: Highest message priority accepted: AMQP's limit (Redis honours 0-9, see ``submit``).
MAX_PRIORITY = 255
#: Longest tenant a submission takes (the column's length).
TENANT_MAX = cast(int, Execution._meta.get_field("tenant").max_length)  # a CharField's


def submit(
    task: str | Task,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    idempotency_key: str | None = None,
    timeout: int | None = None,
    queue: str | None = None,
    priority: int | None = None,
    countdown: float | None = None,
    max_retries: int = 0,
    retry_backoff: int = 1,
    tenant: str = "",
    app: Celery | None = None,
) -> Execution:
    """Record an ad-hoc execution of ``task`` and send it once the transaction commits.

    The same ``idempotency_key`` again returns the existing Execution and sends
    nothing; concurrent calls with one key create one row (the database's
    unique constraint decides). Raises ``SubmissionInvalid`` before writing
    anything when the task is unknown or an argument is malformed.

    ``priority`` (0-255, none by default) is sent as the message's priority.
    Brokers read it differently: Redis honours 0-9 with 0 first (kombu puts
    higher values in the 9 list, and by default groups them in steps 0, 3,
    6, 9); RabbitMQ runs higher values first, up to the queue's
    ``x-max-priority``.

    ``tenant`` scopes the execution as a schedule's tenant scopes its own:
    the API and the admin show it only to callers of that tenant (or unscoped).
    """
    app = app or current_app
    name = task if isinstance(task, str) else task.name
    if not task_policy.is_task_registered(name, app=app):
        raise SubmissionInvalid(f"Unknown task {name!r}: no task with that name is registered.")
    if not task_policy.is_task_guarded(name, app=app):
        raise SubmissionInvalid(task_policy.unguarded_message(name))
    args, kwargs = _checked_arguments(args, kwargs)
    if timeout is not None and (not limits.is_whole_number(timeout) or timeout <= 0):
        raise SubmissionInvalid(f"timeout must be a positive whole number of seconds, got {timeout!r}.")
    if timeout is not None and timeout > limits.INTEGER_MAX:
        raise SubmissionInvalid(f"timeout must be at most {limits.INTEGER_MAX} seconds, got {timeout!r}.")
    now = dbclock.now()
    scheduled_for = _scheduled_for(now, countdown)
    if priority is not None and (not limits.is_whole_number(priority) or not 0 <= priority <= MAX_PRIORITY):
        raise SubmissionInvalid(f"priority must be a whole number from 0 to {MAX_PRIORITY}, got {priority!r}.")
    for label, value in (("max_retries", max_retries), ("retry_backoff", retry_backoff)):
        if not limits.is_whole_number(value) or not 0 <= value <= limits.INTEGER_MAX:
            raise SubmissionInvalid(f"{label} must be a whole number from 0 to {limits.INTEGER_MAX}, got {value!r}.")
    if idempotency_key is not None and not (0 < len(idempotency_key) <= 255):
        raise SubmissionInvalid("idempotency_key must be 1 to 255 characters long.")
    if not isinstance(tenant, str) or len(tenant) > TENANT_MAX:
        raise SubmissionInvalid(f"tenant must be text of at most {TENANT_MAX} characters, got {tenant!r}.")

    execution = Execution(
        idempotency_key=idempotency_key or executions.submit_key(),
        trigger=Execution.Trigger.SUBMIT,
        task=name,
        args=args,
        kwargs=kwargs,
        queue=queue or "",
        priority=priority,
        scheduled_for=scheduled_for,
        timeout=timeout,
        max_retries=max_retries,
        retry_backoff=retry_backoff,
        tenant=tenant,
        celery_task_id=str(uuid.uuid4()),
    )
    execution, created = executions.record_one(execution)
    if not created:
        return execution
    row = executions.message_row(execution)

    def send() -> None:
        try:
            outbox.publish(app, [row], now=now)
        except BrokerUnavailable as exc:
            # The row stays pending: the outbox guarantees the beat leader sends it.
            logger.warning(
                "execution %s recorded but not sent yet (%s); the beat leader will send it",
                execution.pk,
                exc,
                extra={"action": "submit_deferred", "execution_id": execution.pk},
            )

    transaction.on_commit(send)
    return execution


def _checked_arguments(args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise SubmissionInvalid(f"args must be a list or tuple, got {type(args).__name__}.")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise SubmissionInvalid("kwargs must be a dict with string keys.")
    for label, value in (("args", args), ("kwargs", kwargs)):
        problem = limits.argument_problem(value, label=label)
        if problem:
            raise SubmissionInvalid(problem)
    try:
        json.dumps([list(args), kwargs])
    except (TypeError, ValueError) as exc:
        raise SubmissionInvalid(f"args and kwargs must be JSON-serialisable: {exc}") from None
    return list(args), kwargs


_COUNTDOWN_MESSAGE = "countdown must be a number of seconds from 0 that ends before 9000-01-01, got {countdown!r}."


def _scheduled_for(now: datetime, countdown: Any) -> datetime:
    """When a submission ``countdown`` seconds from ``now`` is due; ``SubmissionInvalid`` when it is no such thing."""
    if countdown is None:
        return now
    if not isinstance(countdown, (int, float)) or isinstance(countdown, bool) or not 0 <= countdown < math.inf:
        raise SubmissionInvalid(_COUNTDOWN_MESSAGE.format(countdown=countdown))
    try:
        due = now + timedelta(seconds=countdown)
    except OverflowError:
        due = LATEST
    if due >= LATEST:
        raise SubmissionInvalid(_COUNTDOWN_MESSAGE.format(countdown=countdown))
    return due

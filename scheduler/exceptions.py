"""Errors raised by the scheduler; each one's docstring is its default message."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django.core.exceptions import ValidationError


class SchedulerError(Exception):
    """A scheduler operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ScheduleInvalid(SchedulerError):
    """The schedule's timing is invalid."""


class ScheduleWriteRefused(SchedulerError):
    """Schedules are written through scheduler.owners.schedules (create, save, delete), which keeps their next run, counters and deadline right."""


class TaskRefused(SchedulerError):
    """The caller may not schedule or run this task; nothing was written."""


class LeaseLost(SchedulerError):
    """The lease expired or was taken over before it could be renewed."""

    def __init__(self, message: str | None = None, *, names: tuple[str, ...] = ()) -> None:
        super().__init__(message or (f"Lost {', '.join(names)}" if names else None))
        #: The leases found lost (one or several shards').
        self.names = names


class InFlightLocked(SchedulerError):
    """Another transaction holds an in-flight execution of these schedules; nothing was cancelled."""

    def __init__(self, message: str | None = None, *, schedule_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        #: The schedules whose in-flight executions could not be locked at once.
        self.schedule_ids = schedule_ids


class SubmissionInvalid(SchedulerError):
    """The submission was refused: unknown task or malformed arguments."""


class BackfillRefused(SchedulerError):
    """The backfill was refused; nothing was written."""


class BackfillTooLarge(BackfillRefused):
    """The range holds more slots than one backfill may record; nothing was written."""

    def __init__(self, message: str | None = None, *, capped: bool = False) -> None:
        super().__init__(message)
        #: The bound was the cap (``SCHEDULER_BACKFILL_MAX_SLOTS`` or the call's
        #: ``max_slots``), not the caller's lower ``limit``.
        self.capped = capped


# Raised at the outbox's edge (``scheduler.outbox.errors_as_unavailable``) in
# place of whatever kombu, the transport's client or the socket raised, which
# is its ``__cause__``; its message is the original's.
class BrokerUnavailable(SchedulerError):
    """The broker did not answer."""


class PruneRefused(SchedulerError):
    """The prune was refused: its age or keep-last is not a valid number; nothing was deleted."""


class NotInTask(SchedulerError):
    """fenced() and checkpoint() work only inside a task run by a worker under the execution guard."""


class ClaimLost(SchedulerError):
    """This attempt's claim on the execution moved on (another attempt holds it, or it ended); nothing was written."""


class FenceRefused(SchedulerError):
    """The fenced block was refused; nothing was written."""


class CheckpointInvalid(SchedulerError):
    """The checkpoint was refused: it must be JSON of at most 64 KB; nothing was written."""


class MessageRefused(SchedulerError):
    """The message was not sent for the execution it names, or names it in a way no row can hold; nothing was touched."""

    def __init__(
        self,
        message: str | None = None,
        *,
        reason: str = "",
        execution_id: int | None = None,
        task: str = "",
        celery_task_id: str = "",
        message_task: str = "",
        message_task_id: str = "",
    ) -> None:
        super().__init__(message)
        #: One of ``scheduler.owners.executions.REFUSAL_REASONS``.
        self.reason = reason
        #: The execution the message named, and its task and Celery task id.
        self.execution_id = execution_id
        self.task = task
        self.celery_task_id = celery_task_id
        #: What the message itself carried.
        self.message_task = message_task
        self.message_task_id = message_task_id


def first_line(exc: BaseException) -> str:
    """Return the first line of ``exc``'s message, or its type's name when it has none.

    What an operator is shown of a broker's or a database's error: their
    messages can run to many lines (a traceback from the server, a hint).
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def validation_message(exc: ValidationError) -> str:
    """Flatten a model ValidationError to one line: ``field: message; other: message``."""
    if hasattr(exc, "message_dict"):
        parts = []
        for field, messages in exc.message_dict.items():
            label = "" if field == "__all__" else f"{field}: "
            parts.append(label + " ".join(messages))
        return "; ".join(parts)
    return " ".join(exc.messages)

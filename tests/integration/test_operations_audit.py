"""Each operator action writes its audit event itself, by the actor it is given, in the change's transaction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import transaction

from scheduler.models import AuditEvent, Execution, Schedule
from scheduler.ops import audit, operations
from scheduler.tenancy import EVERY_TENANT
from tests.integration.api_support import make_execution, make_schedule

pytestmark = pytest.mark.django_db

Status = Execution.Status
OPERATOR = audit.Actor(AuditEvent.ActorType.USER, "ada", "team-a")


class Undone(Exception):
    """Raised after an action, inside its caller's transaction, to roll both back."""


def _app() -> Any:
    from project.celery import app

    return app


def _edit(schedule: Schedule) -> None:
    schedule.description = "edited"
    operations.save_schedule(schedule, actor=OPERATOR)


#: One action of each kind, on a schedule "s" (with a failed and a queued execution): (action name, object type, act).
ACTIONS: dict[str, tuple[str, Callable[[Schedule], Any]]] = {
    "create": (
        "scheduler.schedule",
        lambda _: operations.save_schedule(Schedule(name="new", task="scheduler.echo", interval=60), actor=OPERATOR),
    ),
    "update": ("scheduler.schedule", _edit),
    "pause": ("scheduler.schedule", lambda s: operations.pause_schedule(s, "maintenance", actor=OPERATOR)),
    "disable": ("scheduler.schedule", lambda s: operations.set_schedule_enabled(s, False, actor=OPERATOR)),
    "delete": ("scheduler.schedule", lambda s: operations.delete_schedule(s, actor=OPERATOR)),
    "run_now": (
        "scheduler.schedule",
        lambda s: operations.run_now(s, app=_app(), scope=EVERY_TENANT, actor=OPERATOR),
    ),
    "retry": (
        "scheduler.execution",
        lambda s: operations.retry_execution(
            s.executions.get(status=Status.FAILED), app=_app(), scope=EVERY_TENANT, actor=OPERATOR
        ),
    ),
    "cancel": (
        "scheduler.execution",
        lambda s: operations.cancel_execution(s.executions.get(status=Status.QUEUED), app=_app(), actor=OPERATOR),
    ),
}


def _world() -> Schedule:
    schedule = make_schedule("s")
    make_execution(schedule, "k-failed", Status.FAILED)
    make_execution(schedule, "k-queued", Status.QUEUED)
    return schedule


def _rows() -> dict[str, list[tuple[Any, ...]]]:
    return {
        "schedules": sorted(Schedule.objects.values_list("id", "name", "description", "enabled", "paused_reason")),
        "executions": sorted(Execution.objects.values_list("id", "status")),
    }


@pytest.mark.parametrize("name", list(ACTIONS))
def test_an_action__records_one_event_by_its_actor(name: str, redis_client: object) -> None:
    # Given a schedule with a failed and a queued execution
    schedule = _world()
    object_type, act = ACTIONS[name]

    # When the action is taken by an operator
    act(schedule)

    # Then exactly one event says so, naming the operator
    events = list(AuditEvent.objects.values_list("action", "object_type", "actor_type", "actor"))
    assert events == [(name, object_type, AuditEvent.ActorType.USER, "ada")]


def test_an_edit__records_the_fields_it_changed_from_the_stored_row() -> None:
    # Given a schedule whose object already holds the edit (as a form leaves it)
    schedule = make_schedule("s")
    schedule.description = "edited"

    # When it is saved by an operator
    operations.save_schedule(schedule, actor=OPERATOR)

    # Then its event holds the change, from the stored value to the new one
    event = AuditEvent.objects.get()
    assert event.changes["description"] == ["", "edited"]


@pytest.mark.parametrize("name", list(ACTIONS))
def test_an_action_whose_transaction_rolls_back__leaves_no_event(name: str, redis_client: object) -> None:
    # Given a schedule with a failed and a queued execution
    schedule = _world()
    before = _rows()
    _, act = ACTIONS[name]

    # When the action is taken inside a transaction that then rolls back
    with pytest.raises(Undone), transaction.atomic():
        act(schedule)
        assert AuditEvent.objects.count() == 1  # written, inside the transaction
        raise Undone

    # Then neither the change nor its event remains
    assert _rows() == before
    assert not AuditEvent.objects.exists()


def test_a_refused_action__records_nothing() -> None:
    # Given a finished execution
    finished = make_execution(make_schedule("s"), "k-done", Status.SUCCEEDED)

    # When an operator tries to cancel it
    with pytest.raises(operations.ActionRefused):
        operations.cancel_execution(finished, app=_app(), actor=OPERATOR)

    # Then no event is written
    assert not AuditEvent.objects.exists()


def test_a_pause_whose_reason_is_refused__records_nothing() -> None:
    # Given a schedule
    schedule = make_schedule("s")

    # When an operator pauses it with a reason over the length limit
    with pytest.raises(ValidationError, match="paused_reason"):
        operations.pause_schedule(schedule, "x" * 100_000, actor=OPERATOR)

    # Then nothing is paused and no event is written
    assert Schedule.objects.get(pk=schedule.pk).paused_reason == ""
    assert not AuditEvent.objects.exists()

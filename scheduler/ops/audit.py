"""The audit trail: record who changed what through the API, the admin or the CLI.

The operator actions (``scheduler.ops.operations``), given who acts, call
``record()`` after their change succeeded, in its transaction, with the
object's ``snapshot()`` from before the change, so the event holds
``{field: [before, after]}`` for the fields that changed, and commits or
rolls back with the change. The admin, the API and the commands only build
the ``Actor`` (``tests/unit/test_audit_writers.py`` keeps them from recording).

A long write (a backfill, a reconcile, a prune) is not one transaction: its
event is committed before the work, ``state`` "started" with the parameters,
so a crash part-way still leaves a trace, and completed after it with the
counts (``operation()``).

Users, groups, permissions and operator profiles are recorded by model-signal
receivers (``scheduler.ops.access_audit``), whoever changes them; their actor is
``current_actor()``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, transaction
from django.db.models import Model

from scheduler.models import AuditEvent
from scheduler.tenancy import scope_of_user

logger = logging.getLogger(__name__)

#: Fields left out of ``changes``: one that changes on every save and says
#: nothing, one that changes at every login, and a secret's hash, which the
#: trail must not spread.
_IGNORED = frozenset({"updated_at", "last_login", "token_hash"})
#: Secrets whose change is recorded but never their value: ``HIDDEN`` stands
#: for a value, ``CHANGED`` for a new one (a password's hash never reaches the trail).
_MASKED = frozenset({"password", "secret"})
HIDDEN = "(hidden)"
CHANGED = "(changed)"

#: ``changes["state"]`` of a long write's event: committed when it starts, updated when it ends.
STARTED = "started"
COMPLETED = "completed"
FAILED = "failed"


@dataclass(frozen=True)
class Actor:
    """Who acts: a user, a token or the command line, and the tenant it is bound to."""

    type: str
    name: str
    tenant: str = ""


#: Every management command.
CLI = Actor(AuditEvent.ActorType.CLI, "cli")
#: Nobody at hand: the daily prune, and changes made by code outside a request.
SYSTEM = Actor(AuditEvent.ActorType.SYSTEM, "system")

#: Who acts where the writer cannot say (a model signal): an actor, or a
#: request whose user acts (``scheduler.web.middleware.AuditActorMiddleware``).
_acting: ContextVar[Any] = ContextVar("scheduler_audit_acting", default=None)


def user_actor(user: Any) -> Actor:
    """Return the actor for a logged-in user (the admin, or the API with a session)."""
    scope = scope_of_user(user)
    return Actor(AuditEvent.ActorType.USER, user.get_username(), scope.tenant if scope.is_bound else "")


@contextmanager
def acting(who: Any) -> Iterator[None]:
    """Within the block, ``current_actor()`` is ``who``: an ``Actor``, or a request whose user acts."""
    token = _acting.set(who)
    try:
        yield
    finally:
        _acting.reset(token)


def current_actor() -> Actor:
    """Return who acts for an event whose writer is not at hand: as set by ``acting()``, else ``SYSTEM``.

    For a request, its user, read when the event is recorded; an anonymous
    request (or an API token, which no model signal concerns) is ``SYSTEM``.
    """
    who = _acting.get()
    if isinstance(who, Actor):
        return who
    user = getattr(who, "user", None)
    if getattr(user, "is_authenticated", False) and getattr(user, "pk", None) is not None:
        return user_actor(user)
    return SYSTEM


def snapshot(obj: Model | None) -> dict[str, Any]:
    """Return every stored field of ``obj`` as JSON values (empty for no object)."""
    if obj is None:
        return {}
    values = {field.attname: getattr(obj, field.attname) for field in obj._meta.concrete_fields}
    return json.loads(json.dumps(values, cls=DjangoJSONEncoder))


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Return ``{field: [before, after]}`` for the fields whose value differs; a secret's values are masked."""
    fields = (set(before) | set(after)) - _IGNORED
    changes = {}
    for name in sorted(fields):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if name in _MASKED:
            old, new = HIDDEN if old else None, (CHANGED if old else HIDDEN) if new else None
        changes[name] = [old, new]
    return changes


def record(
    actor: Actor,
    action: str,
    obj: Model | None = None,
    *,
    before: dict[str, Any] | None = None,
    deleted: bool = False,
    changes: dict[str, Any] | None = None,
    object_type: str = "",
    tenant: str | None = None,
) -> AuditEvent:
    """Record one audit event; return it.

    ``changes`` defaults to the difference between ``before`` and the object
    now (every field's value before, for a deleted object). The tenant is the
    object's, or else the actor's.
    """
    if changes is None:
        after = {} if deleted else snapshot(obj)
        changes = diff(before or {}, after)
    if tenant is None:
        tenant = getattr(obj, "tenant", "") or actor.tenant
    # A deleted object has lost its primary key; its snapshot kept it.
    pk = None if obj is None else obj.pk if obj.pk is not None else (before or {}).get("id")
    return AuditEvent.objects.create(
        actor_type=actor.type,
        actor=actor.name[:150],
        action=action,
        object_type=object_type or (obj._meta.label_lower if obj is not None else ""),
        object_id="" if pk is None else str(pk),
        object_repr=str(obj)[:255] if obj is not None else "",
        changes=json.loads(json.dumps(changes, cls=DjangoJSONEncoder)),
        tenant=tenant,
    )


def _complete(event: AuditEvent, *, changes: dict[str, Any] | None = None, error: str = "") -> None:
    """Add what the work did to ``event``: ``state`` "completed", or "failed" with ``error``."""
    done = {**event.changes, **json.loads(json.dumps(changes or {}, cls=DjangoJSONEncoder))}
    done["state"] = FAILED if error else COMPLETED
    if error:
        done["error"] = error[:1000]
    AuditEvent.objects.filter(pk=event.pk).update(changes=done)
    event.changes = done


class Operation:
    """The event of one long write, from ``operation()``: ``start()`` before the work, ``done()`` after it."""

    def __init__(self, actor: Actor, action: str, obj: Model | None, *, changes: dict[str, Any], **where: Any) -> None:
        self._record: Callable[[], AuditEvent] = lambda: record(
            actor, action, obj, changes={**changes, "state": STARTED}, **where
        )
        #: The event, once started.
        self.event: AuditEvent | None = None
        self._completed = False

    def start(self) -> None:
        """Record the event, committed at once outside any transaction (once; a hook for work that validates first).

        Outside a transaction, a crash part-way through the work leaves it
        "started"; within a caller's transaction it commits with that one.
        """
        if self.event is None:
            with transaction.atomic():
                self.event = self._record()

    def done(self, changes: dict[str, Any]) -> None:
        """Complete the event with the work's counts (nothing when it never started)."""
        if self.event is not None and not self._completed:
            _complete(self.event, changes=changes)
            self._completed = True

    def failed(self, exc: BaseException) -> None:
        """Mark a started event "failed" with ``exc``; the work's own error is what the caller sees."""
        if self.event is None or self._completed:
            return
        self._completed = True
        try:
            _complete(self.event, error=f"{type(exc).__name__}: {exc}".strip())
        except DatabaseError:
            # The database that failed the work may refuse this too: the event
            # stays "started", which says as much.
            logger.exception("audit event %s not completed", self.event.pk, extra={"action": "audit_not_completed"})


@contextmanager
def operation(
    actor: Actor,
    action: str,
    obj: Model | None = None,
    *,
    changes: dict[str, Any],
    object_type: str = "",
    tenant: str | None = None,
    start: bool = True,
) -> Iterator[Operation]:
    """Audit the long write in the block: one event, committed "started" first, "completed" by ``done()``.

    With ``start=False`` nothing is recorded until ``Operation.start()`` (a
    backfill calls it once its range is accepted, so a refused or dry run
    leaves no event). An exception out of the block marks a started event
    "failed" with its message, and goes on.
    """
    op = Operation(actor, action, obj, changes=changes, object_type=object_type, tenant=tenant)
    if start:
        op.start()
    try:
        yield op
    except BaseException as exc:
        op.failed(exc)
        raise
    op.done({})

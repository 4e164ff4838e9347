"""The audit trail: record who changed what through the API, the admin or the CLI.

Writers call ``record()`` after a change succeeded (in its transaction where
there is one), with the object's ``snapshot()`` from before the change, so the
event holds ``{field: [before, after]}`` for the fields that changed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Model

from scheduler.models import AuditEvent
from scheduler.tenancy import scope_of_user

#: Fields left out of ``changes``: one that changes on every save and says
#: nothing, and a secret's hash, which the trail must not spread.
_IGNORED = frozenset({"updated_at", "token_hash"})


@dataclass(frozen=True)
class Actor:
    """Who acts: a user, a token or the command line, and the tenant it is bound to."""

    type: str
    name: str
    tenant: str = ""


#: Every management command.
CLI = Actor(AuditEvent.ActorType.CLI, "cli")


def user_actor(user: Any) -> Actor:
    """Return the actor for a logged-in user (the admin, or the API with a session)."""
    scope = scope_of_user(user)
    return Actor(AuditEvent.ActorType.USER, user.get_username(), scope.tenant if scope.is_bound else "")


def snapshot(obj: Model | None) -> dict[str, Any]:
    """Return every stored field of ``obj`` as JSON values (empty for no object)."""
    if obj is None:
        return {}
    values = {field.attname: getattr(obj, field.attname) for field in obj._meta.concrete_fields}
    return json.loads(json.dumps(values, cls=DjangoJSONEncoder))


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Return ``{field: [before, after]}`` for the fields whose value differs."""
    fields = (set(before) | set(after)) - _IGNORED
    return {name: [before.get(name), after.get(name)] for name in sorted(fields) if before.get(name) != after.get(name)}


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

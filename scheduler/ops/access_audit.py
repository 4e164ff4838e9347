"""Audit receivers for who may do what: users, groups, their permissions and operator profiles.

These rows change through Django's user and group pages, the operator
profile admin, ``createsuperuser`` and plain code, so model-signal receivers
record them, whoever writes: one event per change, and none for a save that
changes nothing or only ``last_login`` (every login). A password is never
recorded, only that it was set or changed (``audit.diff``). The events
belong to no tenant: only callers of every tenant read them.

A receiver runs inside the change's transaction when there is one (the
admin's views, every delete, every many-to-many change), so the event
commits or rolls back with it; a bare ``save()`` in autocommit (as
``createsuperuser`` does) commits the row, then its event. The actor is
``audit.current_actor()``: the request's user, else "system".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any, cast

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.db.models import Field, Model
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_save

from scheduler.models import OperatorProfile
from scheduler.ops import audit

#: While true, the receivers record nothing (``unaudited()``).
_quiet: ContextVar[bool] = ContextVar("scheduler_access_audit_quiet", default=False)
#: Instance attribute holding the stored row's snapshot between pre_save and post_save.
_BEFORE = "_scheduler_audit_before"


@contextmanager
def unaudited() -> Iterator[None]:
    """Record no event for the changes made in the block."""
    token = _quiet.set(True)
    try:
        yield
    finally:
        _quiet.reset(token)


def connect() -> None:
    """Connect the receivers (from ``SchedulerConfig.ready()``)."""
    for model in (get_user_model(), Group, OperatorProfile):
        uid = f"scheduler.access_audit.{model._meta.label_lower}"
        pre_save.connect(_before_save, sender=model, dispatch_uid=uid)
        post_save.connect(_after_save, sender=model, dispatch_uid=uid)
        post_delete.connect(_after_delete, sender=model, dispatch_uid=uid)
    for through in _owners():
        m2m_changed.connect(
            _many_changed, sender=through, dispatch_uid=f"scheduler.access_audit.{through._meta.label_lower}"
        )


@cache
def _owners() -> dict[type[Model], tuple[type[Model], str]]:
    """{many-to-many table: (the model owning the field, the field)}, each change recorded on the owner."""
    User = get_user_model()
    return {
        User.groups.through: (User, "groups"),
        User.user_permissions.through: (User, "user_permissions"),
        Group.permissions.through: (Group, "permissions"),
    }


def _skipped(raw: bool, update_fields: Any) -> bool:
    # Fixtures being loaded, a quiet block, or a login stamping last_login.
    return raw or _quiet.get() or (update_fields is not None and set(update_fields) <= {"last_login"})


def _before_save(
    sender: type[Model], instance: Model, raw: bool = False, update_fields: Any = None, **kwargs: Any
) -> None:
    if _skipped(raw, update_fields):
        return
    stored = None if instance._state.adding else sender._default_manager.filter(pk=instance.pk).first()
    setattr(instance, _BEFORE, audit.snapshot(stored))


def _after_save(
    sender: type[Model], instance: Model, created: bool, raw: bool = False, update_fields: Any = None, **kwargs: Any
) -> None:
    if _skipped(raw, update_fields):
        return
    before, after = instance.__dict__.pop(_BEFORE, {}), audit.snapshot(instance)
    if update_fields is not None and not created:
        # Only the saved fields: others may hold values the save did not write.
        saved = {cast(Field, sender._meta.get_field(name)).attname for name in update_fields}
        before = {name: value for name, value in before.items() if name in saved}
        after = {name: value for name, value in after.items() if name in saved}
    changes = audit.diff(before, after)
    if created or changes:
        audit.record(audit.current_actor(), "create" if created else "update", instance, changes=changes, tenant="")


def _after_delete(sender: type[Model], instance: Model, **kwargs: Any) -> None:
    if _quiet.get():
        return
    audit.record(audit.current_actor(), "delete", instance, before=audit.snapshot(instance), deleted=True, tenant="")


def _many_changed(
    sender: type[Model], instance: Model, action: str, reverse: bool, pk_set: set[Any] | None, **kwargs: Any
) -> None:
    """Record a change of a user's groups or permissions, or a group's permissions, on the user or group.

    ``pre_*`` notes the owners' current names; ``post_*`` records each owner
    whose names differ. From the other side (``group.user_set.add(user)``)
    the owners are the users named in ``pk_set``.
    """
    if _quiet.get():
        return
    owner_model, field = _owners()[sender]
    stage, _, _ = action.partition("_")
    noted = f"_scheduler_audit_{field}"
    if stage == "pre":
        if pk_set is not None and not pk_set:
            return  # nothing to add or remove
        if not reverse:
            owners: list[Model] = [instance]
        elif pk_set is None:  # clear() from the other side: every owner related to it
            owners = list(owner_model._default_manager.filter(**{field: instance}))
        else:
            owners = list(owner_model._default_manager.filter(pk__in=pk_set))
        setattr(instance, noted, [(owner, _names(owner, field)) for owner in owners])
        return
    actor = audit.current_actor()
    for owner, before in instance.__dict__.pop(noted, []):
        after = _names(owner, field)
        if after != before:
            audit.record(actor, "update", owner, changes={field: [before, after]}, tenant="")


def _names(owner: Model, field: str) -> list[str]:
    """The owner's groups by name, or its permissions as ``app_label.codename``, sorted."""
    related = getattr(owner, field).all()
    if related.model is Permission:
        return sorted(
            f"{app}.{codename}" for app, codename in related.values_list("content_type__app_label", "codename")
        )
    return sorted(related.values_list("name", flat=True))

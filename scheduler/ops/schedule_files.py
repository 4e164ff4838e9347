"""Schedules as a file: export their definitions as YAML, and import such a file back, in one transaction.

A file holds what an operator sets (``FILE_FIELDS``), never what the beat
and the workers record. An import makes the database say what the file
says: one schedule per entry, keyed by tenant and name, created (origin
``import``) or changed field by field, each write audited; with ``prune``
it also turns off the enabled schedules it covers that the file does not
name. Every entry is checked before anything is written, so a file with
one bad entry changes nothing, and a second import of the same file
changes nothing either.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, cast

import yaml
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Field

from scheduler.exceptions import SchedulerError
from scheduler.models import Schedule
from scheduler.models.schedule import MESSAGE_OPTION_FIELDS, POLICY_FIELDS
from scheduler.ops import audit, operations
from scheduler.tenancy import EVERY_TENANT

if TYPE_CHECKING:
    from celery import Celery

#: What a file says of a schedule: its definition, then whether it is on and paused.
DEFINITION_FIELDS = (
    "task",
    "args",
    "kwargs",
    "queue",
    "priority",
    *MESSAGE_OPTION_FIELDS,
    "description",
    "cron",
    "interval",
    "run_at",
    "timezone",
    "start_at",
    "end_at",
    "max_runs",
    "exclude_calendars",
    "only_calendar",
    *POLICY_FIELDS,
)
STATE_FIELDS = ("enabled", "paused_reason")
FILE_FIELDS = ("name", "tenant", *DEFINITION_FIELDS, *STATE_FIELDS)
FORMAT_VERSION = 1
#: Why ``prune`` turned a schedule off.
PRUNED_REASON = "Not in the imported schedules file"


class FileInvalid(SchedulerError):
    """The schedules file cannot be imported: not the format, or an entry the schedule could not hold; nothing was written."""


@dataclass(frozen=True)
class Change:
    """What an import does to one schedule: ``create``, ``update``, ``unchanged`` or ``disable`` (pruned)."""

    tenant: str
    name: str
    verb: str
    #: field -> [stored, from the file] for an update; the file's values for a create.
    fields: dict[str, Any] = field(default_factory=dict)


def export(schedules: Iterable[Schedule]) -> str:
    """Return the YAML file of ``schedules``: ``FILE_FIELDS`` of each, in order."""
    entries = [{name: _plain(getattr(schedule, name)) for name in FILE_FIELDS} for schedule in schedules]
    return yaml.safe_dump({"version": FORMAT_VERSION, "schedules": entries}, sort_keys=False, allow_unicode=True)


def import_file(
    text: str, *, app: Celery, actor: audit.Actor, tenant: str | None, prune: bool, dry_run: bool
) -> list[Change]:
    """Make the schedules say what the file ``text`` says; return each change (a dry run rolls them back).

    ``tenant`` limits the import to that tenant's schedules: an entry of
    another tenant is refused, and ``prune`` looks at that tenant only
    (without it, at every schedule). Raises ``FileInvalid`` with every
    problem found, having written nothing.
    """
    entries = _entries(text, tenant=tenant)
    with transaction.atomic():
        plans = [_plan(entry) for entry in entries]
        problems = [problem for schedule, change in plans for problem in _problems(schedule, change, app=app)]
        if problems:
            raise FileInvalid("; ".join(problems))
        changes = [_apply(schedule, change, actor=actor) for schedule, change in plans]
        if prune:
            changes += _prune({(change.tenant, change.name) for change in changes}, tenant=tenant, actor=actor)
        transaction.set_rollback(dry_run)
    return changes


def _entries(text: str, *, tenant: str | None) -> list[dict[str, Any]]:
    """Parse and check the file's shape; return its entries, each with every ``FILE_FIELDS`` key."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FileInvalid(f"not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(document, dict) or not isinstance(document.get("schedules"), list):
        raise FileInvalid("a schedules file is a mapping with a list under 'schedules' (as `schedules export` writes)")
    if document.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise FileInvalid(f"version {document['version']!r} is not one this release reads ({FORMAT_VERSION})")
    entries, seen = [], set()
    for number, entry in enumerate(document["schedules"], start=1):
        where = f"entry {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise FileInvalid(f"{where}: a mapping with a 'name' is expected")
        where = f"entry {number} ({entry['name']!r})"
        unknown = sorted(set(entry) - set(FILE_FIELDS))
        if unknown:
            raise FileInvalid(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
        entry_tenant = entry.get("tenant") or ""
        if tenant is not None and entry_tenant != tenant:
            raise FileInvalid(f"{where}: of tenant {entry_tenant!r}, not {tenant!r}")
        key = (entry_tenant, entry["name"])
        if key in seen:
            raise FileInvalid(f"{where}: named twice for tenant {entry_tenant!r}")
        seen.add(key)
        entries.append({name: _value(name, entry.get(name), where=where) for name in FILE_FIELDS})
    return entries


def _plan(entry: dict[str, Any]) -> tuple[Schedule, Change]:
    """Return the schedule as the file wants it (unsaved edits), and what changes."""
    stored = Schedule.objects.select_for_update().filter(tenant=entry["tenant"], name=entry["name"]).first()
    if stored is None:
        schedule = Schedule(origin=Schedule.Origin.IMPORT, **entry)
        return schedule, Change(entry["tenant"], entry["name"], "create", {k: _plain(v) for k, v in entry.items()})
    changed = {name: [_plain(getattr(stored, name)), _plain(value)] for name, value in entry.items()}
    changed = {name: pair for name, pair in changed.items() if pair[0] != pair[1]}
    for name in DEFINITION_FIELDS:
        setattr(stored, name, entry[name])
    return stored, Change(entry["tenant"], entry["name"], "update" if changed else "unchanged", changed)


def _problems(schedule: Schedule, change: Change, *, app: Celery) -> list[str]:
    if change.verb == "unchanged":
        return []
    candidate = copy.copy(schedule)  # checked with the state the file gives it, which _apply sets by its own actions
    for name in STATE_FIELDS:
        if name in change.fields and change.verb == "update":
            setattr(candidate, name, change.fields[name][1])
    try:
        operations.validate_schedule(candidate, app=app, scope=EVERY_TENANT)
    except ValidationError as exc:
        return [f"{change.name!r}: {field}: {' '.join(messages)}" for field, messages in exc.message_dict.items()]
    return []


def _apply(schedule: Schedule, change: Change, *, actor: audit.Actor) -> Change:
    if change.verb == "create":
        operations.save_schedule(schedule, actor=actor, action="import")
    elif change.verb == "update":
        # The definition as one edit; then on/off and pause as the actions they are (a resume starts afresh).
        definition = [name for name in change.fields if name in DEFINITION_FIELDS]
        if definition:
            operations.save_schedule(schedule, actor=actor, fields=definition, action="import")
        if "paused_reason" in change.fields:
            paused_reason = change.fields["paused_reason"][1]
            if paused_reason:
                operations.pause_schedule(schedule, paused_reason, actor=actor)
            else:
                operations.resume_schedule(schedule, actor=actor)
        if "enabled" in change.fields:
            operations.set_schedule_enabled(schedule, change.fields["enabled"][1], actor=actor)
    return change


def _prune(named: set[tuple[str, str]], *, tenant: str | None, actor: audit.Actor) -> list[Change]:
    """Turn off the enabled schedules (of ``tenant``, if given) that the file does not name."""
    candidates = Schedule.objects.filter(enabled=True).order_by("tenant", "name")
    if tenant is not None:
        candidates = candidates.filter(tenant=tenant)
    changes = []
    for schedule in candidates.select_for_update():
        if (schedule.tenant, schedule.name) in named:
            continue
        schedule.enabled, schedule.disabled_reason = False, PRUNED_REASON
        operations.save_schedule(schedule, actor=actor, fields=["enabled", "disabled_reason"], action="disable")
        changes.append(Change(schedule.tenant, schedule.name, "disable", {"enabled": [True, False]}))
    return changes


def _value(name: str, value: Any, *, where: str) -> Any:
    """Return the file's ``value`` as the model field holds it (a date-time from its ISO text; empty: the default)."""
    model_field = cast(Field, Schedule._meta.get_field(name))  # FILE_FIELDS are the table's own columns
    if value is None and not model_field.null:
        return model_field.get_default()
    try:
        return model_field.to_python(value)
    except ValidationError as exc:
        raise FileInvalid(f"{where}: {name}: {' '.join(exc.messages)}") from None


def _plain(value: Any) -> Any:
    """Return ``value`` as YAML writes it and reads it back: a date-time as ISO text in UTC."""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return value

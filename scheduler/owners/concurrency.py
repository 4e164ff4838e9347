"""Concurrency limits: the only writer of their rows, the limits in force as each process sees them, and keys.

A limit caps how many executions of the work it matches run at once across
every worker: all of it under one key, or one key per value of a declared
argument. The worker's claim enforces it in the claim's own statement
(``scheduler.owners.executions.claim``); an execution over the limit waits
``queued`` and is offered again, oldest first, when a slot of its key frees.
Workers read the limits at most once every ``CACHE_SECONDS`` (``in_force``),
so a new limit governs the next claims within that long.
"""

from __future__ import annotations

import hashlib
import re
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.models import ConcurrencyLimit
from scheduler.owners import pause_rules

#: How long a process keeps the limits it read before it reads them again.
CACHE_SECONDS = 1.0
#: A key value longer than this is stored as its digest (the column holds 255 characters).
VALUE_MAX_LENGTH = 200

_FIELD = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)$")

_cached: tuple[float, tuple[Limit, ...]] | None = None


@dataclass(frozen=True)
class Slot:
    """The key an execution runs under and how many of that key may run at once."""

    key: str
    limit: int


@dataclass(frozen=True)
class Limit:
    """A concurrency limit as read: matched against work by its task, queue and tenant."""

    pk: int
    name: str
    tenant: str
    every_tenant: bool
    task: str
    queue: str
    key: str
    limit: int

    @classmethod
    def of(cls, row: ConcurrencyLimit) -> Limit:
        return cls(row.pk, row.name, row.tenant, row.every_tenant, row.task, row.queue, row.key, row.limit)

    def matches(self, *, task: str, queue: str, tenant: str) -> bool:
        return (
            (self.every_tenant or tenant == self.tenant)
            and (not self.queue or queue == self.queue)
            and (not self.task or re.match(pause_rules.glob_regex(self.task), task) is not None)
        )

    def slot(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> Slot:
        """The slot of the work called with ``args`` and ``kwargs`` under this limit."""
        return Slot(f"{self.pk}:{key_value(self.key, args or (), kwargs or {})}", self.limit)


def limit_id(key: str) -> int:
    """The id of the limit a stored ``concurrency_key`` belongs to."""
    return int(key.split(":", 1)[0])


def template(key: str) -> str:
    """The format template of a limit's ``key``: a bare argument name stands for ``{name}``."""
    return f"{{{key}}}" if _FIELD.match(key) else key


def key_problem(key: str) -> str:
    """Why ``key`` is refused as a limit's key ("" when it is not).

    Only argument names and positions may be named, without attributes,
    indexes, conversions or format specs: the template is filled from the
    caller's arguments, and ``{0.__class__}`` must not reach into them.
    """
    if not key:
        return ""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template(key))]
    except ValueError as error:
        return f"the key {key!r} is not a template: {error}"
    names = [entry for entry in fields if entry[0] is not None]
    if not names:
        return f"the key {key!r} names no argument: write an argument name, or a template such as {{customer_id}}"
    for name, spec, conversion in names:
        if not _FIELD.match(name or "") or spec or conversion:
            return (
                f"the key {key!r} may only name arguments, as {{customer_id}} or {{0}}, "
                f"without attributes, indexes, conversions or formats (not {{{name}}})"
            )
    return ""


def key_value(key: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The value of ``key`` for these arguments; "" when the limit has no key, or an argument is missing.

    Work without the argument shares the key "" of its limit.
    """
    if not key:
        return ""
    try:
        value = template(key).format(*args, **kwargs)
    except (IndexError, KeyError):
        return ""
    if len(value) > VALUE_MAX_LENGTH:
        return "sha256-" + hashlib.sha256(value.encode()).hexdigest()
    return value


def in_force(*, max_age: float = CACHE_SECONDS) -> tuple[Limit, ...]:
    """Return the limits in force, as read at most ``max_age`` seconds ago in this process."""
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] >= max_age:
        _cached = (now, tuple(Limit.of(row) for row in ConcurrencyLimit.objects.order_by("pk")))
    return _cached[1]


def governing(limits: tuple[Limit, ...], *, task: str, queue: str, tenant: str) -> Limit | None:
    """The limit that governs this work: the oldest that matches it (one limit per execution)."""
    return next((limit for limit in limits if limit.matches(task=task, queue=queue, tenant=tenant)), None)


def save(row: ConcurrencyLimit) -> ConcurrencyLimit:
    """Write ``row``; processes see it within ``CACHE_SECONDS``, this one at once."""
    row.save()
    forget()
    return row


def delete(row: ConcurrencyLimit) -> None:
    ConcurrencyLimit.objects.filter(pk=row.pk).delete()
    forget()


def forget() -> None:
    """Read the limits afresh next time (this process changed them)."""
    global _cached
    _cached = None

"""The rules on work: pauses that hold it, limits on how much of it runs at once and how fast it starts.

The only writer of their rows. All three match work by its task, queue and
tenant, and each process reads them at most once every ``CACHE_SECONDS``
(``pauses_in_force``, ``limits_in_force``, ``rates_in_force``), in one
read, so a new rule governs the next claims within that long.

A pause rule holds the work it matches: the beat dispatches none of its
schedules' slots (``held``), and a worker claims none of its executions
(``matching``), which wait ``queued`` until the rule is lifted; the beat
reads the rules at each pass.

A concurrency limit caps how many executions of the work it matches run at
once across every worker: all of it under one key, or one key per value of
a declared argument. The worker's claim enforces it in the claim's own
statement (``scheduler.owners.executions.claim``); an execution over the
limit waits ``queued`` and is offered again, oldest first, when a place of
its key frees.

A rate limit spreads the starts of the work it matches evenly, one every
``per_seconds / starts`` per key, so no window of its period holds more
than its number of starts: a worker takes the next start of the key
(``reserve_start``, one locked row per key in the database) before its
claim, and waits for it, or sends the execution again for later.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import re
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import transaction
from django.db.models import Q

from scheduler import dbclock
from scheduler.models import ConcurrencyLimit, PauseRule, RateLimit, RateLimitKey

#: How long a process keeps the rules it read before it reads them again.
CACHE_SECONDS = 1.0
#: Most ``*`` a pattern may hold: each one multiplies how long a regular
#: expression engine that backtracks (Python's; SQLite's REGEXP is Python's)
#: takes to refuse a name that does not match.
GLOB_MAX_STARS = 4

#: {rule table: (when read, its rules)}.
_cached: dict[type, tuple[float, tuple[Any, ...]]] = {}


def glob_problem(pattern: str) -> str:
    """Why ``pattern`` is refused ("" when it is not): too many ``*``."""
    if pattern.count("*") > GLOB_MAX_STARS:
        return f"a pattern may hold at most {GLOB_MAX_STARS} *, not {pattern.count('*')}"
    return ""


def glob_regex(pattern: str) -> str:
    """The anchored regular expression of a shell-style ``pattern`` (``*`` any run, ``?`` one character).

    The same expression filters in SQL (``__regex``) and in Python, so both agree on what matches.
    """
    return "^" + re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".") + "$"


@dataclass(frozen=True)
class Rule:
    """A pause rule as read: matched against work by its task, queue and tenant."""

    pk: int
    tenant: str
    every_tenant: bool
    queue: str
    task: str
    mode: str
    reason: str

    @classmethod
    def of(cls, row: PauseRule) -> Rule:
        return cls(row.pk, row.tenant, row.every_tenant, row.queue, row.task, row.mode, row.reason)

    def matches(self, *, task: str, queue: str, tenant: str) -> bool:
        return (
            (self.every_tenant or tenant == self.tenant)
            and (not self.queue or queue == self.queue)
            and (not self.task or re.match(glob_regex(self.task), task) is not None)
        )

    def condition(self) -> Q:
        """The filter for rows (schedules or executions: ``task``, ``queue``, ``tenant``) this rule matches."""
        # Every row: a Q() would vanish when OR-ed with the other rules' filters.
        condition = ~Q(pk__in=[]) if self.every_tenant else Q(tenant=self.tenant)
        if self.queue:
            condition &= Q(queue=self.queue)
        if self.task:
            condition &= Q(task__regex=glob_regex(self.task))
        return condition


def create_pause(**fields: object) -> PauseRule:
    """Insert a rule; return it. Processes see it within ``CACHE_SECONDS``; this one at once."""
    row = PauseRule.objects.create(**fields)
    forget()
    return row


def delete_pause(rule: PauseRule) -> None:
    PauseRule.objects.filter(pk=rule.pk).delete()
    forget()


def forget() -> None:
    """Read the rules afresh next time (this process changed them)."""
    _cached.clear()


def _read(model: type[PauseRule | ConcurrencyLimit | RateLimit], max_age: float) -> tuple[Any, ...]:
    """The rules of one table, as read at most ``max_age`` seconds ago (each table apart: the beat reads pauses only)."""
    now = time.monotonic()
    cached = _cached.get(model)
    if cached is None or now - cached[0] >= max_age:
        cached = _cached[model] = (now, tuple(_READ_AS[model](row) for row in model.objects.order_by("pk")))
    return cached[1]


def pauses_in_force(*, max_age: float = CACHE_SECONDS) -> tuple[Rule, ...]:
    """Return the pause rules in force, as read at most ``max_age`` seconds ago in this process."""
    return _read(PauseRule, max_age)


def limits_in_force(*, max_age: float = CACHE_SECONDS) -> tuple[Limit, ...]:
    """Return the concurrency limits in force, as read at most ``max_age`` seconds ago in this process."""
    return _read(ConcurrencyLimit, max_age)


def rates_in_force(*, max_age: float = CACHE_SECONDS) -> tuple[Rate, ...]:
    """Return the rate limits in force, as read at most ``max_age`` seconds ago in this process."""
    return _read(RateLimit, max_age)


def matching(rules: tuple[Rule, ...], *, task: str, queue: str, tenant: str) -> Rule | None:
    """Return the rule that holds this work (a drain before a hold), or ``None``."""
    found = [rule for rule in rules if rule.matches(task=task, queue=queue, tenant=tenant)]
    return min(found, key=lambda rule: (rule.mode != PauseRule.Mode.DRAIN, rule.pk), default=None)


def held(rules: tuple[Rule, ...]) -> Q | None:
    """The filter for rows any of ``rules`` matches; ``None`` when there are none."""
    if not rules:
        return None
    return functools.reduce(operator.or_, (rule.condition() for rule in rules))


# --- concurrency limits -------------------------------------------------------------

#: A key value longer than this is stored as its digest (the column holds 255 characters).
VALUE_MAX_LENGTH = 200

_FIELD = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)$")


@dataclass(frozen=True)
class Place:
    """The key an execution runs under and how many of that key may run at once."""

    key: str
    limit: int


@dataclass(frozen=True)
class _WorkLimit:
    """What a concurrency or rate limit as read shares: matched against work by its task, queue and tenant."""

    pk: int
    name: str
    tenant: str
    every_tenant: bool
    task: str
    queue: str
    key: str

    def matches(self, *, task: str, queue: str, tenant: str) -> bool:
        return (
            (self.every_tenant or tenant == self.tenant)
            and (not self.queue or queue == self.queue)
            and (not self.task or re.match(glob_regex(self.task), task) is not None)
        )

    def key_of(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """``<id>:<value>``: the key of the work called with ``args`` and ``kwargs`` under this limit."""
        return f"{self.pk}:{key_value(self.key, args or (), kwargs or {})}"


@dataclass(frozen=True)
class Limit(_WorkLimit):
    """A concurrency limit as read."""

    limit: int

    @classmethod
    def of(cls, row: ConcurrencyLimit) -> Limit:
        return cls(row.pk, row.name, row.tenant, row.every_tenant, row.task, row.queue, row.key, row.limit)

    def place(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> Place:
        """The place the work called with ``args`` and ``kwargs`` takes under this limit."""
        return Place(self.key_of(args, kwargs), self.limit)


@dataclass(frozen=True)
class Rate(_WorkLimit):
    """A rate limit as read: one start every ``interval`` seconds per key."""

    interval: float

    @classmethod
    def of(cls, row: RateLimit) -> Rate:
        interval = row.per_seconds / row.starts
        return cls(row.pk, row.name, row.tenant, row.every_tenant, row.task, row.queue, row.key, interval)


_READ_AS: dict[type, Any] = {PauseRule: Rule.of, ConcurrencyLimit: Limit.of, RateLimit: Rate.of}


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


def problems(row: ConcurrencyLimit | RateLimit) -> dict[str, list[str]]:
    """What is wrong with ``row`` as a limit to keep, by field (empty: nothing)."""
    found: dict[str, list[str]] = {}
    if not row.name.strip():
        found["name"] = ["Name the limit."]
    if glob_problem(row.task):
        found["task"] = [f"Task pattern refused: {glob_problem(row.task)}."]
    if key_problem(row.key):
        found["key"] = [key_problem(row.key)[0].upper() + key_problem(row.key)[1:] + "."]
    if isinstance(row, ConcurrencyLimit):
        if not isinstance(row.limit, int) or row.limit < 1:
            found["limit"] = ["A limit lets at least 1 run at once."]
    else:
        if not isinstance(row.starts, int) or row.starts < 1:
            found["starts"] = ["A rate lets at least 1 start per period."]
        if not isinstance(row.per_seconds, int) or row.per_seconds < 1:
            found["per_seconds"] = ["A period is at least 1 second."]
    return found


_Governing = TypeVar("_Governing", bound=_WorkLimit)


def governing(limits: tuple[_Governing, ...], *, task: str, queue: str, tenant: str) -> _Governing | None:
    """The limit of ``limits`` that governs this work: the oldest that matches it (one of a kind per execution)."""
    return next((limit for limit in limits if limit.matches(task=task, queue=queue, tenant=tenant)), None)


def save_limit(row: ConcurrencyLimit | RateLimit) -> None:
    """Write ``row``; processes see it within ``CACHE_SECONDS``, this one at once."""
    row.save()
    forget()


def delete_limit(row: ConcurrencyLimit | RateLimit) -> None:
    type(row).objects.filter(pk=row.pk).delete()
    if isinstance(row, RateLimit):
        RateLimitKey.objects.filter(key__startswith=f"{row.pk}:").delete()
    forget()


# --- rate limits --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """A start taken (``reserved``: wait ``seconds``, then start), or not (the next free start is ``seconds`` away)."""

    reserved: bool
    seconds: float


def reserve_start(rate: Rate, key: str, *, within: float, now: float | None = None) -> Reservation:
    """Take the next start of ``key`` under ``rate`` if it is at most ``within`` seconds after ``now``.

    ``now``: seconds since the epoch, by default the database clock's.
    Starts are spread evenly (one every ``rate.interval``), so no window of
    the limit's period holds more than its number of starts. The key's row
    is locked while its next start moves on, so two workers never take the
    same one.
    """
    now = dbclock.now().timestamp() if now is None else now
    with transaction.atomic():
        row, _ = RateLimitKey.objects.select_for_update().get_or_create(key=key, defaults={"next_start": now})
        start = max(row.next_start, now)
        if start - now > within:
            return Reservation(False, start - now)
        RateLimitKey.objects.filter(pk=row.pk).update(next_start=start + rate.interval)
    return Reservation(True, start - now)

"""The pause rules: the only writer of their rows, the rules in force as each process sees them, and what they match.

A rule holds the work it matches: the beat dispatches none of its
schedules' slots (``exclude``), and a worker claims none of its executions
(``matching``), which wait ``queued`` until the rule is lifted. Workers
read the rules at most once every ``CACHE_SECONDS`` (``in_force``), so a
new rule holds the next claims within that long; the beat reads them at
each pass.
"""

from __future__ import annotations

import functools
import operator
import re
import time
from dataclasses import dataclass

from django.db.models import Q

from scheduler.models import PauseRule

#: How long a process keeps the rules it read before it reads them again.
CACHE_SECONDS = 1.0
#: Most ``*`` a pattern may hold: each one multiplies how long a regular
#: expression engine that backtracks (Python's; SQLite's REGEXP is Python's)
#: takes to refuse a name that does not match.
GLOB_MAX_STARS = 4

_cached: tuple[float, tuple[Rule, ...]] | None = None


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


def create(**fields: object) -> PauseRule:
    """Insert a rule; return it. Processes see it within ``CACHE_SECONDS``; this one at once."""
    row = PauseRule.objects.create(**fields)
    forget()
    return row


def delete(rule: PauseRule) -> None:
    PauseRule.objects.filter(pk=rule.pk).delete()
    forget()


def forget() -> None:
    """Read the rules afresh next time (this process changed them)."""
    global _cached
    _cached = None


def in_force(*, max_age: float = CACHE_SECONDS) -> tuple[Rule, ...]:
    """Return the rules in force, as read at most ``max_age`` seconds ago in this process."""
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] >= max_age:
        _cached = (now, tuple(Rule.of(row) for row in PauseRule.objects.order_by("pk")))
    return _cached[1]


def matching(rules: tuple[Rule, ...], *, task: str, queue: str, tenant: str) -> Rule | None:
    """Return the rule that holds this work (a drain before a hold), or ``None``."""
    found = [rule for rule in rules if rule.matches(task=task, queue=queue, tenant=tenant)]
    return min(found, key=lambda rule: (rule.mode != PauseRule.Mode.DRAIN, rule.pk), default=None)


def held(rules: tuple[Rule, ...]) -> Q | None:
    """The filter for rows any of ``rules`` matches; ``None`` when there are none."""
    if not rules:
        return None
    return functools.reduce(operator.or_, (rule.condition() for rule in rules))

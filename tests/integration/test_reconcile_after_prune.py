"""Reconcile after a prune: a slot that ran and was since pruned is never reported or recorded again (guarantee 10).

Whatever a prune's arguments (the command's ``--older-than`` and
``--keep-last``, the daily task's days), it marks each schedule whose rows
it deleted with the newest slot deleted (``pruned_through``), in the same
transaction, and reconcile's audit starts after that mark.
"""

from __future__ import annotations

import io
import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from django.core.management import call_command

import scheduler.ops.reconcile as reconcile_module
from project.celery import app
from scheduler import dbclock, tasks, timing
from scheduler.models import Execution, Schedule
from scheduler.ops import prune
from scheduler.ops.reconcile import reconcile
from scheduler.owners import executions, schedules

pytestmark = pytest.mark.django_db(transaction=True)

Status = Execution.Status


def command(*argv: str) -> str:
    out = io.StringIO()
    call_command(*argv, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def audited(*flags: str) -> dict[int, list[tuple[str, datetime]]]:
    """Run ``manage.py reconcile [flags] --json``; return each schedule's audit changes as (kind, slot)."""
    found: dict[int, list[tuple[str, datetime]]] = {}
    for change in json.loads(command("reconcile", *flags, "--json"))["changes"]:
        if change["kind"] in ("missing_slot", "slot_recorded"):
            match = re.search(r": slot (\S+) ", change["detail"])
            assert match, change
            found.setdefault(change["schedule_id"], []).append((change["kind"], datetime.fromisoformat(match[1])))
    return found


def with_history(name: str, *, interval: int, count: int, gap: slice) -> tuple[Schedule, list[datetime]]:
    """A ``run_all`` schedule owing its last ``count`` slots, each run and succeeded but ``slots[gap]``.

    The slot after the last one is due (its ``next_run_at``), so later slots
    are the beat's, not the audit's. Return the schedule and its gap's slots.
    """
    now = dbclock.now()
    last = datetime.fromtimestamp(int(now.timestamp()) // interval * interval, tz=timezone.utc)
    start = last - timedelta(seconds=interval * count)
    target = Schedule(
        name=name, task="scheduler.echo", interval=interval, misfire="run_all", catchup_window=interval * count + 3600
    )
    target.full_clean()
    schedules.save(target)
    Schedule.objects.filter(pk=target.pk).update(
        created_at=start, owed_since=start, next_run_at=last + timedelta(seconds=interval)
    )
    target.refresh_from_db()
    slots = timing.slots_between(target.timing, since=start, until=last)
    assert len(slots) == count and slots[-1] == last
    missing = slots[gap]
    Execution.objects.bulk_create(
        executions.execution_for(target, slot, status=Status.SUCCEEDED, now=slot + timedelta(milliseconds=500))
        for slot in slots
        if slot not in missing
    )
    return target, missing


def slots_run(target: Schedule) -> set[datetime]:
    return set(Execution.objects.filter(schedule=target).values_list("scheduled_for", flat=True))


def pruned_through(target: Schedule) -> datetime | None:
    return Schedule.objects.values_list("pruned_through", flat=True).get(pk=target.pk)


@pytest.mark.parametrize(
    "prune_args",
    [("--older-than", "300s"), ("--older-than", "1s", "--keep-last", "300")],
    ids=["older-than", "keep-last"],
)
def test_reconcile_after_prune__pruned_slots_not_reported_or_recorded_and_missing_ones_are(
    redis_client: redis.Redis, prune_args: tuple[str, ...]
) -> None:
    # Given an every-second run_all schedule whose last 600 slots all ran but 10 (200-209 s ago),
    # and another whose last 100 slots all ran but 5 (50-54 s ago)
    busy, busy_gap = with_history("busy", interval=1, count=600, gap=slice(-210, -200))
    quiet, quiet_gap = with_history("quiet", interval=1, count=100, gap=slice(-55, -50))
    ran = slots_run(busy)

    # When about the older half of the first one's runs is pruned
    command("prune_executions", *prune_args)
    pruned = ran - slots_run(busy)
    assert 250 <= len(pruned) <= 350, len(pruned)
    horizon = max(pruned)
    assert horizon < min(busy_gap)

    # And reconcile reports what is missing, then repairs it
    reported = audited()
    repaired = audited("--repair")

    # Then only the slots that never ran are reported and recorded, none up to the pruned horizon
    assert reported == {
        busy.pk: [("missing_slot", slot) for slot in busy_gap],
        quiet.pk: [("missing_slot", slot) for slot in quiet_gap],
    }
    assert repaired == {
        busy.pk: [("slot_recorded", slot) for slot in busy_gap],
        quiet.pk: [("slot_recorded", slot) for slot in quiet_gap],
    }
    assert not Execution.objects.filter(schedule=busy, scheduled_for__lte=horizon).exists()
    assert redis_client.llen("celery") == len(busy_gap) + len(quiet_gap)

    # And each schedule is marked with the newest slot pruned of it, or not at all,
    # and a prune that deletes nothing moves no mark
    assert (pruned_through(busy), pruned_through(quiet)) == (horizon, None)
    assert command("prune_executions", "--older-than", "1h").startswith("deleted 0 ")
    assert (pruned_through(busy), pruned_through(quiet)) == (horizon, None)


def test_daily_prune_task__pruned_slots_not_reported_or_recorded_and_missing_ones_are(
    redis_client: redis.Redis,
) -> None:
    # Given a five-minute run_all schedule whose last two days of slots all ran but three, six hours ago
    target, gap = with_history("five-minutely", interval=300, count=576, gap=slice(-75, -72))
    ran = slots_run(target)

    # When the daily prune task deletes what finished over a day ago
    result = tasks.prune_executions.run(older_than_days=1)
    pruned = ran - slots_run(target)
    assert result["deleted"] == len(pruned) >= 280
    horizon = max(pruned)
    assert horizon < min(gap)

    # And reconcile reports what is missing, then repairs it
    reported = audited()
    repaired = audited("--repair")

    # Then only the three slots that never ran are reported and recorded
    assert reported == {target.pk: [("missing_slot", slot) for slot in gap]}
    assert repaired == {target.pk: [("slot_recorded", slot) for slot in gap]}
    assert not Execution.objects.filter(schedule=target, scheduled_for__lte=horizon).exists()
    assert redis_client.llen("celery") == len(gap)
    # And the schedule is marked with the newest slot the task deleted
    assert pruned_through(target) == horizon


def test_prune_commits_between_the_audits_reads__its_slots_not_reported(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an every-second schedule whose last 600 slots all ran but 10 (200-209 s ago)
    busy, gap = with_history("busy", interval=1, count=600, gap=slice(-210, -200))
    read_keys = reconcile_module._present_keys

    def prune_first(keys: list[str]) -> set[str]:
        prune.prune_executions(older_than=dbclock.now() - timedelta(seconds=300))
        return read_keys(keys)

    # When a prune commits after the audit read the schedule, before it reads the executions
    monkeypatch.setattr(reconcile_module, "_present_keys", prune_first)
    report = reconcile(now=dbclock.now(), app=app)

    # Then the slots it pruned are not reported, the ones that never ran are
    assert [(change.kind, change.detail) for change in report.changes] == [
        ("missing_slot", f"busy: slot {slot.isoformat()} has no execution") for slot in gap
    ]
    assert pruned_through(busy) is not None


def test_prune_commits_before_a_repair_records__nothing_up_to_its_mark_recorded(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an every-second schedule whose last 600 slots all ran but 10 (400-409 s ago)
    busy, gap = with_history("busy", interval=1, count=600, gap=slice(-410, -400))
    plan = reconcile_module._misfire_plan

    def prune_first(*args: Any, **kwargs: Any) -> list[tuple[datetime, str]]:
        prune.prune_executions(older_than=dbclock.now() - timedelta(seconds=300))
        return plan(*args, **kwargs)

    # When the audit found the gap missing, and a prune of the runs before 300 s ago commits before the repair records it
    monkeypatch.setattr(reconcile_module, "_misfire_plan", prune_first)
    report = reconcile(now=dbclock.now(), repair=True, app=app)

    # Then the gap, now before the prune's mark, is not owed: nothing is recorded or sent
    assert report.changes == ()
    assert redis_client.llen("celery") == 0
    mark = pruned_through(busy)
    assert mark is not None and max(gap) < mark
    assert not Execution.objects.filter(schedule=busy, scheduled_for__lte=mark).exists()

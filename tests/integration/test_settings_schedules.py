"""``beat_schedule`` entries as schedules: upserted with their options, retired when gone, never a tenant's row."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import pytest
from celery.schedules import crontab
from kombu import Exchange

from project.celery import app
from scheduler.models import Schedule
from scheduler.ops.builtin_schedules import PRUNE_EXECUTIONS, ensure_builtin_schedules
from scheduler.ops.settings_schedules import RETIRED_REASON, sync_beat_schedule
from scheduler.owners import schedules
from tests.support.factories import make_execution, make_schedule

UTC = timezone.utc

pytestmark = pytest.mark.django_db(transaction=True)

Origin = Schedule.Origin


def test_entries__upserted_with_their_options_and_runtime_state_kept() -> None:
    # Given Celery's own beat_schedule setting with an interval and a crontab entry, and a broken one
    beat_schedule = {
        "every ten": {"task": "scheduler.echo", "schedule": 10.0, "args": (1,)},
        "nightly": {
            "task": "scheduler.echo",
            "schedule": crontab(minute="30", hour="2"),
            "options": {"queue": "q", "priority": 7, "soft_time_limit": 59.5, "time_limit": 90},
        },
        "broken": {"task": "scheduler.echo"},
    }
    # When synced twice (a second replica starting)
    assert sync_beat_schedule(beat_schedule) == ["every ten", "nightly"]
    Schedule.objects.filter(name="every ten").update(enabled=False)
    sync_beat_schedule(beat_schedule)

    # Then one row each, marked as the setting's, runtime state kept, the bad entry ignored
    every = Schedule.objects.get(name="every ten")
    nightly = Schedule.objects.get(name="nightly")
    assert (every.interval, every.args, every.enabled, every.origin) == (10, [1], False, Origin.SETTINGS)
    assert (nightly.cron, nightly.queue, nightly.priority, nightly.timeout) == ("30 2 * * *", "q", 7, 60)
    assert nightly.origin == Origin.SETTINGS
    assert not Schedule.objects.filter(name="broken").exists()


def test_entries__every_message_option_is_carried_and_only_countdown_and_eta_are_named_as_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = {
        "time_limit": 30,
        "expires": 9.5,
        "headers": {"x-team": "billing"},
        "exchange": Exchange("billing", type="direct"),
        "routing_key": "billing.nightly",
        "countdown": 5,
    }
    moment = {"task": "scheduler.echo", "schedule": 60, "options": {"expires": datetime(2030, 1, 1, tzinfo=UTC)}}
    with caplog.at_level(logging.WARNING, logger="scheduler.ops.settings_schedules"):
        sync_beat_schedule(
            {"limited": {"task": "scheduler.echo", "schedule": 60, "options": options}, "moment": moment}
        )
    limited = Schedule.objects.get(name="limited")
    assert (limited.timeout, limited.expires, limited.headers) == (30, 10, {"x-team": "billing"})
    assert (limited.exchange, limited.routing_key) == ("billing", "billing.nightly")
    assert "entry 'limited': options countdown are not carried" in caplog.text
    assert "entry 'moment': options expires (a moment, not seconds) are not carried" in caplog.text
    assert Schedule.objects.get(name="moment").expires is None


def test_an_entry_gone_turns_its_schedule_off_keeping_history_and_back_on_when_it_returns() -> None:
    # Given two entries synced, one with a run in its history
    entries = {
        "keep": {"task": "scheduler.echo", "schedule": 60},
        "drop": {"task": "scheduler.echo", "schedule": 60},
    }
    sync_beat_schedule(entries)
    dropped = Schedule.objects.get(name="drop")
    make_execution("drop-run", schedule=dropped)

    # When the setting loses one entry
    sync_beat_schedule({"keep": entries["keep"]})

    # Then its schedule is off with the reason, its history kept; the other runs on
    dropped.refresh_from_db()
    assert (dropped.enabled, dropped.disabled_reason) == (False, RETIRED_REASON)
    assert dropped.executions.count() == 1
    assert Schedule.objects.get(name="keep").enabled
    # And when the entry comes back, so does its schedule
    sync_beat_schedule(entries)
    dropped.refresh_from_db()
    assert (dropped.enabled, dropped.disabled_reason) == (True, "")


def test_only_the_settings_own_schedules_are_retired_and_one_turned_off_by_hand_stays_off() -> None:
    # Given a deployer's schedule made by hand, a tenant's made from nothing in the setting,
    # and a setting's schedule an operator turned off
    manual = make_schedule("manual", interval=60)
    sync_beat_schedule({"by-code": {"task": "scheduler.echo", "schedule": 60}})
    by_code = Schedule.objects.get(name="by-code")
    schedules.set_enabled(by_code, False)

    # When the setting is emptied, then refilled
    sync_beat_schedule({})
    sync_beat_schedule({"by-code": {"task": "scheduler.echo", "schedule": 60}})

    # Then the hand-made one still runs, and the one turned off by hand stays off
    manual.refresh_from_db()
    by_code.refresh_from_db()
    assert (manual.enabled, manual.origin) == (True, Origin.MANUAL)
    assert (by_code.enabled, by_code.disabled_reason) == (False, "")


def test_a_tenants_schedule_of_the_same_name_is_never_taken_over() -> None:
    # Given a tenant's schedule named like an entry the deployer adds later
    tenants = make_schedule("billing", tenant="acme", task="tests.record", interval=3600)
    # When the beat syncs the deployer's entry
    sync_beat_schedule({"billing": {"task": "scheduler.echo", "schedule": 60}})
    # Then the tenant's row is untouched, and the deployer's is a row of its own
    tenants.refresh_from_db()
    assert (tenants.task, tenants.interval, tenants.origin) == ("tests.record", 3600, Origin.MANUAL)
    deployers = Schedule.objects.get(name="billing", tenant="")
    assert (deployers.task, deployers.origin) == ("scheduler.echo", Origin.SETTINGS)
    # And retiring the entry leaves the tenant's schedule alone
    sync_beat_schedule({})
    tenants.refresh_from_db()
    assert tenants.enabled


def test_a_tenants_schedule_named_like_a_builtin_does_not_keep_the_builtin_away() -> None:
    make_schedule(PRUNE_EXECUTIONS, tenant="acme", task="tests.record", interval=3600)
    assert PRUNE_EXECUTIONS in ensure_builtin_schedules(app)
    builtin = Schedule.objects.get(name=PRUNE_EXECUTIONS, tenant="")
    assert builtin.origin == Origin.BUILTIN

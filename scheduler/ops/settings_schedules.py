"""Celery's ``beat_schedule`` setting as schedules: the code owns its entries.

Each entry is a schedule of the deployer (no tenant) with origin
``settings``, created or updated at every beat start; what the setting does
not say (the state, the counters, the history, the policies set in the
admin) is kept. An entry gone from the setting turns its schedule off with
``RETIRED_REASON``, keeping its history; an entry that comes back turns it
on again. A schedule turned off for any other reason stays off.
"""

from __future__ import annotations

import logging
import math
from datetime import timedelta
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as every
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from scheduler.models import Schedule
from scheduler.owners import schedules

logger = logging.getLogger(__name__)

#: Why a schedule made from ``beat_schedule`` was turned off; one with this reason is turned on when its entry returns.
RETIRED_REASON = "Its entry is no longer in the beat_schedule setting"
#: Entry options with no field here: named in a warning, not carried. A schedule's slot is its start
#: time, so there is nothing to delay; ``expires`` as a moment (not seconds) has no field either.
UNCARRIED_OPTIONS = ("countdown", "eta")


def _timing_fields(value: Any) -> dict[str, Any]:
    """Translate a Celery schedule value into our timing fields."""
    if isinstance(value, (int, float)):
        value = timedelta(seconds=value)
    if isinstance(value, timedelta):
        return {"cron": "", "interval": max(int(value.total_seconds()), 1), "run_at": None}
    if isinstance(value, crontab):
        # crontab keeps the user's text only in these private attributes (celery-types omits them).
        parts = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        fields = tuple(getattr(value, f"_orig_{part}") for part in parts)
        return {"cron": " ".join(str(f) for f in fields), "interval": None, "run_at": None}
    if isinstance(value, every):
        # celery-types omits the attribute schedule.__init__ sets.
        run_every: timedelta = value.run_every  # type: ignore[attr-defined]
        return {"cron": "", "interval": max(int(run_every.total_seconds()), 1), "run_at": None}
    raise ValueError(f"unsupported schedule type {type(value).__name__}")


def _option_fields(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Translate an entry's ``options`` (``apply_async``'s) into our fields.

    The soft time limit is the execution's ``timeout`` (the hard one follows
    it by ``SCHEDULER_TIMEOUT_GRACE_SECONDS``); an entry with only a hard
    limit gets it as its timeout. ``expires`` in seconds counts from each
    slot; an ``exchange`` may be given as kombu's ``Exchange``.
    """
    limit = options.get("soft_time_limit") or options.get("time_limit")
    expires = options.get("expires")
    uncarried = [option for option in UNCARRIED_OPTIONS if option in options]
    if expires is not None and not isinstance(expires, (int, float)):
        uncarried.append("expires (a moment, not seconds)")
        expires = None
    if uncarried:
        logger.warning(
            "beat_schedule entry %r: options %s are not carried to its schedule",
            name,
            ", ".join(sorted(uncarried)),
            extra={"action": "settings_schedule_options_dropped"},
        )
    exchange = options.get("exchange") or ""
    return {
        "queue": options.get("queue") or "",
        "priority": options.get("priority"),
        "timeout": math.ceil(limit) if limit else None,
        "expires": max(math.ceil(expires), 1) if expires is not None else None,
        "headers": dict(options.get("headers") or {}),
        "exchange": getattr(exchange, "name", exchange),
        "routing_key": options.get("routing_key") or "",
    }


def _entry_fields(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": entry["task"],
        "args": list(entry.get("args") or []),
        "kwargs": dict(entry.get("kwargs") or {}),
        **_option_fields(name, entry.get("options") or {}),
        **_timing_fields(entry["schedule"]),
    }


def sync_beat_schedule(beat_schedule: dict[str, dict[str, Any]]) -> list[str]:
    """Create or update one schedule per ``beat_schedule`` entry, retire those whose entry is gone; return the synced names.

    An invalid entry is logged and skipped, so one bad entry never stops
    the beat; its schedule, if it has one, is left as it was.
    """
    synced = []
    named = set()
    for name, entry in (beat_schedule or {}).items():
        named.add(name)
        try:
            values = _entry_fields(name, entry)
        except (KeyError, TypeError, ValueError) as exc:
            logger.error("beat_schedule entry %r ignored: %s", name, exc, extra={"action": "settings_schedule_invalid"})
            continue
        if _upsert(name, values):
            synced.append(name)
    for name in schedules.retire(Schedule.Origin.SETTINGS, keep=named, reason=RETIRED_REASON):
        logger.info("schedule %r turned off: %s", name, RETIRED_REASON, extra={"action": "settings_schedule_retired"})
    return synced


def _upsert(name: str, values: dict[str, Any]) -> bool:
    """Create or update the deployer's schedule ``name`` from its entry; return whether it is in step with it."""
    values = {**values, "origin": Schedule.Origin.SETTINGS}
    for _ in range(2):  # a second replica may create the same row concurrently
        try:
            with transaction.atomic():
                # The deployer's own (no tenant): a tenant's schedule of the same name is another schedule.
                found = Schedule.objects.select_for_update().filter(tenant="", name=name).first()
                schedule = found or Schedule(name=name)
                if not schedule.enabled and schedule.disabled_reason == RETIRED_REASON:
                    values["enabled"] = True  # its entry is back
                changed = schedule._state.adding or any(getattr(schedule, k) != v for k, v in values.items())
                if changed:
                    for key, value in values.items():
                        setattr(schedule, key, value)
                    schedule.full_clean(validate_unique=False)
                    schedules.save(schedule)
            return True
        except IntegrityError:
            continue
        except ValidationError as exc:
            logger.error("beat_schedule entry %r ignored: %s", name, exc, extra={"action": "settings_schedule_invalid"})
            return False
    return False
